//! Which device tensors live on: `--device cpu | cuda | cuda:N | auto`.

use candle_core::Device;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--device {0}: unknown device (use cpu, cuda, cuda:N or auto)")]
    Unknown(String),
    #[error("--device {0}: this iris binary was built without CUDA support (build with --features cuda)")]
    NotCompiled(String),
    #[error("--device {spec}: no usable CUDA GPU ({reason})")]
    Unavailable { spec: String, reason: String },
}

/// `--batch-invariant`: the CUDA kernels that would choose how to sum by the size of the batch
/// take the choice that gives every row the same bits in any batch: dense 16-bit products go
/// through `ops::invariant_matmul` at every row count, decode attention runs one query head a
/// block and the TurboQuant decode attention a fixed split count. Process-wide (one engine a
/// process serves), set when an engine is built; the CPU kernels are batch-invariant always.
static BATCH_INVARIANT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_batch_invariant(on: bool) {
    BATCH_INVARIANT.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub fn batch_invariant() -> bool {
    BATCH_INVARIANT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Parses and opens a device. `auto` is the first CUDA GPU when this build has CUDA support and
/// one is present, else the CPU.
pub fn open(spec: &str) -> Result<Device, DeviceError> {
    let ordinal = match spec {
        "cpu" => return Ok(Device::Cpu),
        "auto" => return Ok(if cfg!(feature = "cuda") { cuda(0).unwrap_or(Device::Cpu) } else { Device::Cpu }),
        "cuda" => 0,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => return Err(DeviceError::Unknown(s.to_string())),
        },
    };
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::NotCompiled(spec.to_string()));
    }
    cuda(ordinal).map_err(|reason| DeviceError::Unavailable { spec: spec.to_string(), reason })
}

/// Held while a device is created and while a CUDA graph is captured: creating a device
/// synchronizes the context, which would break a capture running on another thread of the
/// same process (tests run several engines at once; a server runs one).
#[cfg(feature = "cuda")]
static CUDA_SETUP: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`CUDA_SETUP`] (device creation here, graph capture in the engine and in tests).
#[cfg(feature = "cuda")]
pub fn cuda_setup_lock() -> std::sync::MutexGuard<'static, ()> {
    CUDA_SETUP.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens CUDA device `ordinal` on a stream of its own. Everything iris runs goes to that one
/// stream, so the per-tensor event tracking cudarc does for multi-stream use is switched off
/// (it costs host time on every launch and cannot be captured into a graph).
#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device, String> {
    let _setup = cuda_setup_lock();
    let count = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().map_err(|e| e.to_string())?;
    if ordinal >= count.max(0) as usize {
        return Err(format!("{count} CUDA device(s) found"));
    }
    let device = Device::new_cuda_with_stream(ordinal).map_err(|e| e.to_string())?;
    let cuda = device.as_cuda_device().map_err(|e| e.to_string())?;
    // SAFETY: iris issues all work on this device's one stream.
    unsafe { cuda.disable_event_tracking() };
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> Result<Device, String> {
    Err("built without CUDA support".into())
}

/// Free and total bytes of the device's memory; None on the CPU.
pub fn memory_info(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok().map(|(f, t)| (f as u64, t as u64));
    }
    let _ = device;
    None
}
