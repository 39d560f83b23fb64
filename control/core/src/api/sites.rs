//! The typed requests and responses of the sites module's methods.
