//! The e2e suite: one test binary, one module per feature (`exporter`, `snapshot`, `vmexport`)
//! and one for what they all stand on (`platform`), all against one local control plane
//! (`hack/test/e2e.sh` starts it and names it in `UCM_E2E_KUBECONFIG`; without it the first test
//! starts one for the process). Test names read `<area>::<module>::<test>` (e.g.
//! `exporter::grpc::…`, `platform::faults::…`), so `hack/test/e2e.sh --test <area>[::<module>]`
//! selects an area or a part of one. The soak run (`soak.rs`) is a binary of its own, outside
//! `make test`.
//!
//! Process-wide state is shared by every area: the control plane and the CRD install
//! (`ucm_testkit`, re-exported by `common`), Keycloak (`exporter::jumpstarter::keycloak`), and
//! the snapshot-coordinator lock (`common::sole_snapshot_coordinator`) that keeps tests which
//! need to be the cluster's only MiroirSnapshot coordinator apart from every other manager
//! running the snapshot feature.

// The e2e fixture: the ucm-testkit crate (shared with the benches) and the manager fixture.
mod common;
// A world of every feature with agents and traffic, shared by `platform::faults` and the soak binary.
mod rig;

mod exporter;
mod platform;
mod snapshot;
mod vmexport;
