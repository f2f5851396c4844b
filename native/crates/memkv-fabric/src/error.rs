//! The error of every fallible call of this crate.

use crate::sys::Lib;

/// A libfabric call that failed: which call, libfabric's error code (positive; 0 for a failure
/// of memkv's own, such as a library that cannot be loaded) and its text.
#[derive(Debug, Clone)]
pub struct FabricError {
    pub op: &'static str,
    pub code: i32,
    pub msg: String,
}

impl std::fmt::Display for FabricError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.msg)?;
        if self.code != 0 {
            write!(f, " ({})", self.code)?;
        }
        Ok(())
    }
}

impl std::error::Error for FabricError {}

impl FabricError {
    pub(crate) fn new(op: &'static str, code: i32) -> FabricError {
        let msg = Lib::get().map_or_else(|e| e, |l| l.strerror(code));
        FabricError {
            op,
            code: code.abs(),
            msg,
        }
    }

    pub(crate) fn other(op: &'static str, msg: impl Into<String>) -> FabricError {
        FabricError {
            op,
            code: 0,
            msg: msg.into(),
        }
    }

    /// True when the operation's deadline passed (the endpoint was closed to stop it).
    pub fn timed_out(&self) -> bool {
        self.code == libc::ETIMEDOUT
    }
}

pub(crate) type Result<T> = std::result::Result<T, FabricError>;
