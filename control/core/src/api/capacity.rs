//! The typed requests and responses of the capacity module's methods.
