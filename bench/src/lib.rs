//! bc-bench: benchmark programs run by `scripts/bench <name>`; each prints figures beside a peer measured in the same run and ends with one summary line.
