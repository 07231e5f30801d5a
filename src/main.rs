//! ucm: the Unified Controller Manager.
// Interim dispatch until the runtime's CLI lands (the lead owns this file).
fn main() {
    let sub = std::env::args().nth(1);
    match sub.as_deref() {
        Some("export-server") => std::process::exit(ucm::vmexport::server::main()),
        _ => {
            eprintln!("usage: ucm export-server");
            std::process::exit(2);
        }
    }
}
