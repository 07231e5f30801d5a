//! The e2e suite: one test binary, one module per feature area, all against one local control
//! plane (`hack/e2e.sh` starts it and names it in `UCM_E2E_KUBECONFIG`; without it the first test
//! starts one for the process). Test names read `<area>::<test>`, so `hack/e2e.sh --test <area>`
//! selects an area. The soak run (`soak.rs`) is a binary of its own, outside `make test`.
//!
//! Process-wide state is shared by every area: the control plane and the CRD install
//! (`common`), Keycloak (`jumpstarter::keycloak`), and the snapshot-coordinator lock
//! (`common::sole_snapshot_coordinator`) that keeps tests which need to be the cluster's only
//! MiroirSnapshot coordinator apart from every other manager running the snapshot feature.

mod common;
// A world of every feature with agents and traffic, shared by `faults` and the soak binary.
mod rig;

mod bad_input;
mod cluster;
mod deploy;
mod exporter;
mod faults;
mod grpc;
mod hooks;
mod jumpstarter;
mod node;
mod runtime;
mod security;
mod snapshot;
mod vmexport;
mod vmexport_server;
