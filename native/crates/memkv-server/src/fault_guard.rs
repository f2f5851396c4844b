//! Copies between the server's memory and a client's mapped region that survive the client
//! shrinking the file under the mapping. Touching a page past a file's end raises SIGBUS; a
//! client could otherwise kill the server by truncating the memory it handed over. While a
//! thread copies, it names the region it copies from or into (thread-local); a SIGBUS inside
//! that region replaces the whole region's mapping with anonymous zero pages, so the copy runs
//! to its end on them, and the copy reports the fault. The region is then dead: its transfers
//! fail as REMOTE_ACCESS. A SIGBUS anywhere else goes to the handler that was there before
//! (the default kills the process, as without this guard).
//!
//! Connections share a mapping (`crate::shm`), so another thread may be copying in the mapping a
//! fault replaced: its copy lands in the anonymous pages, not the client's file, and raises
//! nothing. The handler therefore also records which mapping it replaced, and every copy that
//! overlapped a fault looks there before it reports success.

use std::cell::Cell;
use std::sync::atomic::{compiler_fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

thread_local! {
    /// The mapping (start, length) this thread copies from or into now; (0, 0) when none.
    static ACCESS: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Set by the handler when a fault hit `ACCESS`.
    static FAULTED: Cell<bool> = const { Cell::new(false) };
}

/// The SIGBUS action before ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Faults recorded so far; a copy compares it before and after.
static FAULTS: AtomicU64 = AtomicU64::new(0);
/// Slots of `REPLACED` taken (a fault takes one, then counts itself in `FAULTS`).
static RESERVED: AtomicU64 = AtomicU64::new(0);
/// The starts of the mappings the last faults replaced, by slot number modulo its length.
static REPLACED: [AtomicUsize; 64] = [const { AtomicUsize::new(0) }; 64];

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let (start, len) = ACCESS.with(Cell::get);
    if len != 0 && addr >= start && addr < start + len {
        // Recorded before the mapping is replaced, so that a copy another thread makes into the
        // replacement finds it when it looks after its copy. Lock-free atomics are
        // async-signal-safe.
        let n = RESERVED.fetch_add(1, Ordering::AcqRel);
        REPLACED[(n % REPLACED.len() as u64) as usize].store(start, Ordering::Release);
        FAULTS.fetch_add(1, Ordering::AcqRel);
        // SAFETY: [start, start + len) is the mapping this thread is copying in; replacing it
        // keeps it mapped (mmap is async-signal-safe on Linux).
        unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
        }
        FAULTED.with(|f| f.set(true));
        return;
    }
    // Not ours: put the previous action back; the faulting access repeats and meets it.
    if let Some(prev) = PREVIOUS.get() {
        // SAFETY: restores an action the kernel gave us.
        unsafe { libc::sigaction(libc::SIGBUS, prev, std::ptr::null_mut()) };
    }
}

/// Installs the handler once per process (the server calls this before it maps any region).
pub fn install() {
    PREVIOUS.get_or_init(|| {
        // SAFETY: sigaction with a handler of the SA_SIGINFO signature and an empty mask.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            let mut prev: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, &act, &mut prev);
            prev
        }
    });
}

/// Copies `len` bytes from `src` to `dst`, one of which lies in the client mapping
/// `mapping` (start, length); false when the mapping faulted (it is anonymous memory now).
///
/// # Safety
/// Both ranges must be mapped and not overlap; `install` must have run.
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, mapping: (usize, usize)) -> bool {
    let before = FAULTS.load(Ordering::Acquire);
    ACCESS.with(|a| a.set(mapping));
    FAULTED.with(|f| f.set(false));
    compiler_fence(Ordering::SeqCst);
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    compiler_fence(Ordering::SeqCst);
    ACCESS.with(|a| a.set((0, 0)));
    !FAULTED.with(Cell::get) && !replaced_since(before, mapping.0)
}

/// Whether a fault after count `before` replaced the mapping starting at `start`. More faults
/// than slots since then count as a hit: the copy fails rather than trust an overwritten slot.
fn replaced_since(before: u64, start: usize) -> bool {
    if FAULTS.load(Ordering::Acquire) == before {
        return false;
    }
    // Every slot taken since, recorded or being recorded (faults in two threads at once).
    let taken = RESERVED.load(Ordering::Acquire);
    if taken - before > REPLACED.len() as u64 {
        return true;
    }
    (before..taken)
        .any(|n| REPLACED[(n % REPLACED.len() as u64) as usize].load(Ordering::Acquire) == start)
}
