//! The typed requests and responses of the nodes module's methods.
