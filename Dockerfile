# One image for every ucm process: the manager, the snapshot agent, the router and the export
# server (`ucm <subcommand>`). A static musl binary on a distroless base: no shell, no package
# manager, non-root (uid 65532) by default.
#
#   docker build -t <registry>/ucm:<tag> .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/ucm:<tag> --push .
#
# The binary is at /usr/local/bin/ucm, on PATH: the vmexport feature starts export-server Pods with
# `ucm export-server`, and the snapshot agent's DaemonSet mounts the host's tool directories over
# /usr/bin, /usr/sbin, /bin and /sbin, which leaves /usr/local/bin alone.

# Alpine's Rust targets musl natively, so the binary is statically linked on every platform
# without a cross toolchain (ring's C and assembly parts need only musl-dev).
FROM docker.io/library/rust:1.89-alpine AS build
RUN apk add --no-cache musl-dev
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml names the e2e test targets; the manifest must resolve them even for a --bin build.
COPY e2e/tests ./e2e/tests
ENV CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_PROFILE_RELEASE_LTO=thin \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ucm \
 && cp target/release/ucm /ucm \
 && /ucm --version

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build --chmod=0755 /ucm /usr/local/bin/ucm
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ucm"]
CMD ["--help"]
