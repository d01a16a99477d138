//! State dicts (being written).
