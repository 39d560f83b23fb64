//! The control plane's inventory module (moving in from bc-control).
