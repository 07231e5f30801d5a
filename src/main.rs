fn main() {
    ucm::cli::main();
}
