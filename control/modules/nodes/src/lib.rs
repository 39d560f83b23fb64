//! The control plane's nodes module (moving in from bc-control).
