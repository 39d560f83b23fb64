//! The control plane's sites module (moving in from bc-control).
