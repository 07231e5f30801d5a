// mimalloc returns freed pages to the OS after a burst (a bulk create, a relist); glibc's
// per-thread arenas kept about twice the live cache resident after the bench's bulk steps.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    ucm::cli::main();
}
