# One image for every ucm process: the manager, the snapshot agent, the router and the export
# server (`ucm <subcommand>`). A static binary on a distroless-like root built FROM scratch: no
# shell, no package manager, non-root (uid/gid 65532 "nonroot", as in distroless), a CA bundle.
#
# Two ways to build the same final stage:
# - With Docker (registries reachable): the `build` stage below compiles a static musl binary.
#     docker build -t <registry>/ucm:<tag> .
#     docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/ucm:<tag> --push .
# - Without Docker or a registry (`make image`, hack/build/image.sh): buildah (Debian) builds this file
#   with `--build-context build=<dir>`, which replaces the `build` stage by a directory holding a
#   static glibc binary (`-C target-feature=+crt-static`; rustup has no musl target there) and
#   the host's CA bundle, laid out as below. The rust:alpine image is never pulled, and the final
#   stage needs no base image, so the result is the same root file system and config.
#
# The binary is at /usr/local/bin/ucm, on PATH: the vmexport feature starts export-server Pods with
# `ucm export-server`, and the snapshot agent's DaemonSet mounts the host's tool directories over
# /usr/bin, /usr/sbin, /bin and /sbin, which leaves /usr/local/bin alone.

# Alpine's Rust targets musl natively, so the binary is statically linked on every platform
# without a cross toolchain (ring's C and assembly parts need only musl-dev). The stage's
# contract with the final one: /ucm and /etc/ssl/certs/ca-certificates.crt.
FROM docker.io/library/rust:1.89-alpine AS build
RUN apk add --no-cache musl-dev ca-certificates
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml names the e2e test targets; the manifest must resolve them even for a --bin build.
COPY e2e/tests ./e2e/tests
# The workspace's dev-only fixture crate: Cargo reads it to resolve the lock file.
COPY testkit ./testkit
# The build context holds no .git: `docker build --build-arg UCM_GIT_REVISION=$(git rev-parse
# --short HEAD)` stamps the revision (ucm_build_info); hack/build/image.sh builds on the host, from git.
ARG UCM_GIT_REVISION=unknown
ENV UCM_GIT_REVISION=$UCM_GIT_REVISION \
    CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_PROFILE_RELEASE_LTO=thin \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ucm \
 && cp target/release/ucm /ucm \
 && /ucm --version

# What distroless/static-debian12:nonroot provides and ucm uses: passwd/group with nonroot
# (65532), the CA bundle, nothing else.
FROM scratch
COPY deploy/image/etc/passwd deploy/image/etc/group /etc/
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build --chmod=0755 /ucm /usr/local/bin/ucm
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ucm"]
CMD ["--help"]
