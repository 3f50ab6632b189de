//! A global allocator that counts, per thread, the allocations made and the bytes held, for the
//! tests and benches that measure them; per thread, so tests running in parallel do not disturb
//! each other. Included with `#[path]` by `tests/holder.rs`, `tests/home.rs` and
//! `benches/home_grant.rs`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Allocations and reallocations this thread made.
    static CALLS: Cell<u64> = const { Cell::new(0) };
    /// Bytes this thread allocated, less those it freed.
    static BYTES: Cell<isize> = const { Cell::new(0) };
}

fn count(calls: u64, bytes: isize) {
    let _ = CALLS.try_with(|c| c.set(c.get() + calls));
    let _ = BYTES.try_with(|b| b.set(b.get() + bytes));
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are thread-local `Cell`s
// with const initialisers and no destructors, so updating them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(1, layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(0, -(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(1, new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations (and reallocations) this thread has made.
pub fn allocations() -> u64 {
    CALLS.with(Cell::get)
}

/// Bytes this thread holds: allocated, less freed.
pub fn allocated() -> isize {
    BYTES.with(Cell::get)
}
