//! The control plane's capacity module (moving in from bc-control).
