//! Which instruction set the CPU kernels run with: the best the CPU has, or the one
//! `IRIS_CPU_ISA` names (for tests and A/B runs), and the dispatch into kernels generic over
//! `Simd`.

use std::sync::OnceLock;

use super::lanes::Simd;
use super::portable::Portable;

/// An instruction set the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F and BW.
    Avx512,
    /// AVX2 and FMA (x86-64-v3).
    Avx2,
    /// aarch64's Advanced SIMD.
    Neon,
    /// Plain Rust, lane by lane.
    Portable,
}

#[derive(Debug, thiserror::Error)]
pub enum IsaError {
    #[error("IRIS_CPU_ISA={0:?} is not an instruction set iris knows: use avx512, avx2, neon or portable")]
    Unknown(String),
    #[error("IRIS_CPU_ISA={0} asks for an instruction set this CPU does not have (it has: {1})")]
    Unsupported(&'static str, String),
}

/// A kernel generic over the instruction set: `Isa::run` calls `run` with the set's `Simd`,
/// inside a function compiled for that set (so `run` and what it calls must be
/// `#[inline(always)]` to be compiled with it).
pub trait WithSimd {
    type Output;
    fn run<S: Simd>(self, s: S) -> Self::Output;
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU runs the set (detected once: `run` asks on every kernel call).
    pub fn supported(self) -> bool {
        static SUPPORTED: OnceLock<[bool; 4]> = OnceLock::new();
        SUPPORTED.get_or_init(|| Isa::ALL.map(Isa::detect))[self as usize]
    }

    fn detect(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => true,
            Isa::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The sets this CPU runs, best first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// The best set this CPU runs.
    pub fn best() -> Isa {
        Isa::available()[0]
    }

    /// The set `IRIS_CPU_ISA` asks for, else the best one; an error when the variable names
    /// no set or one this CPU lacks (the CLI reports it before it loads anything).
    pub fn from_env() -> Result<Isa, IsaError> {
        match std::env::var("IRIS_CPU_ISA") {
            Err(_) => Ok(Isa::best()),
            Ok(v) => {
                let isa = Isa::ALL
                    .into_iter()
                    .find(|i| i.name().eq_ignore_ascii_case(v.trim()))
                    .ok_or_else(|| IsaError::Unknown(v.clone()))?;
                if !isa.supported() {
                    let have: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
                    return Err(IsaError::Unsupported(isa.name(), have.join(", ")));
                }
                Ok(isa)
            }
        }
    }

    /// The set the kernels use in this process: `from_env`, read once (an unusable
    /// `IRIS_CPU_ISA` falls back to the best set; the CLI refuses it at start).
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| Isa::from_env().unwrap_or_else(|_| Isa::best()))
    }

    /// Runs `k` with this set, or with the portable one where the CPU lacks it (only tests
    /// name sets explicitly, from `available`).
    #[inline]
    pub fn run<K: WithSimd>(self, k: K) -> K::Output {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has the set (checked).
            Isa::Avx512 if self.supported() => unsafe { run_avx512(k) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 if self.supported() => unsafe { run_avx2(k) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => k.run(super::neon::Neon(())),
            _ => k.run(Portable),
        }
    }
}

/// Runs `k` in the process's active set.
#[inline]
pub fn run<K: WithSimd>(k: K) -> K::Output {
    Isa::active().run(k)
}

/// # Safety
/// AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run_avx512<K: WithSimd>(k: K) -> K::Output {
    k.run(super::avx512::Avx512(()))
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<K: WithSimd>(k: K) -> K::Output {
    k.run(super::avx2::Avx2(()))
}
