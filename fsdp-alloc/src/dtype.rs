//! Element types: the shared vocabulary of buffers, collectives and tensors.

/// The element type of a buffer or tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// Lower-case name (`f32`, `bf16`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// True for floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "f32" | "fp32" | "float32" => DType::F32,
            "f16" | "fp16" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" => DType::I32,
            "i64" => DType::I64,
            "u8" => DType::U8,
            _ => {
                return Err(format!(
                    "unknown dtype `{s}` (expected f32, f16, bf16, i32, i64 or u8)"
                ))
            }
        })
    }
}
