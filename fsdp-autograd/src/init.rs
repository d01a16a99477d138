//! Parameter initialisation descriptions (`InitOp`) and a counter-based RNG. Owned by the init
//! helper; filled in separately.
