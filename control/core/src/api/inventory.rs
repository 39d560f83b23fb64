//! The typed requests and responses of the inventory module's methods.
