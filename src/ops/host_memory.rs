//! Host buffers that the CPU kernels stream through every step (the KV cache, packed
//! quantized weights), on transparent huge pages where Linux allows it.
//!
//! A decode step at long contexts reads the whole cache, hundreds of megabytes, and every
//! 4 KiB page of it costs a TLB miss: 8,192 positions of SmolLM2's f32 cache took 0.93 ms of
//! attention per layer on 4 KiB pages and 0.80 ms on 2 MiB ones (`cargo bench --bench
//! prefill_attention -- --rows 1 --contexts 8192 --layers 30`, this repo's 2-core Zen 4).
//! Linux backs a region with huge pages on first touch once it is advised (MADV_HUGEPAGE),
//! which its default setting (`transparent_hugepage/enabled` = madvise) honours. So buffers
//! are allocated zeroed, untouched (a fresh mapping), and advised before anything writes them.

/// Element types whose all-zero bytes are the value zero.
pub trait Zeroable: Copy {}
impl Zeroable for u8 {}
impl Zeroable for f32 {}
impl Zeroable for half::bf16 {}
impl Zeroable for half::f16 {}

const HUGE_PAGE: usize = 2 << 20;

/// `n` zeros, the whole 2 MiB pages inside advised to be huge pages (smaller buffers, other
/// systems, or a kernel that refuses: ordinary pages, the same zeros).
pub fn zeroed<T: Zeroable>(n: usize) -> Vec<T> {
    let bytes = n * std::mem::size_of::<T>();
    if bytes < HUGE_PAGE {
        return vec![zero(); n];
    }
    let layout = std::alloc::Layout::array::<T>(n).expect("a buffer that fits in memory");
    // SAFETY: `layout` is non-zero in size; the memory is zeroed, which is a valid T (the
    // trait's promise), and is handed to a Vec with the layout it was allocated with.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        advise_huge(p as *mut u8, bytes);
        Vec::from_raw_parts(p, n, n)
    }
}

/// A zero of `T` (all-zero bytes, as `Zeroable` promises).
fn zero<T: Zeroable>() -> T {
    // SAFETY: all-zero bytes are a valid T for every `Zeroable`.
    unsafe { std::mem::zeroed() }
}

#[cfg(target_os = "linux")]
fn advise_huge(p: *mut u8, bytes: usize) {
    let start = (p as usize).next_multiple_of(HUGE_PAGE);
    let end = (p as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if start < end {
        // SAFETY: [start, end) lies inside the allocation just made; advice changes no data.
        // A refusal (THP off) leaves ordinary pages: nothing to report.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: *mut u8, _: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeros_of_the_asked_length() {
        for n in [0, 5, (3 << 20) + 7] {
            let v: Vec<f32> = zeroed(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
            let b: Vec<half::bf16> = zeroed(n);
            assert!(b.len() == n && b.iter().all(|x| x.to_f32() == 0.0));
        }
    }
}
