//! Generates the Jumpstarter gRPC code from the committed FileDescriptorSet (no protoc): the set
//! was extracted from the published `jumpstarter-protocol` 0.9.0 package (see
//! `src/exporter/proto/README.md`), so the wire schema is never written by hand.

use prost::Message;

const FDS: &str = "src/exporter/proto/jumpstarter-protocol-0.9.0.fds";

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed={FDS}");
    let bytes = std::fs::read(FDS)?;
    let fds = prost_types::FileDescriptorSet::decode(bytes.as_slice())
        .map_err(|e| std::io::Error::other(format!("{FDS}: {e}")))?;
    // Only the jumpstarter files are generated; google/* types come from prost-types or are
    // generated too when they have no Rust counterpart (annotations are options only).
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // RPCs ucm does not serve answer Unimplemented.
        .generate_default_stubs(true)
        .compile_fds(fds)
}
