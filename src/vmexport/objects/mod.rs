//! Pure builders of what a pass writes (docs/architecture.md, "How a pass is built";
//! docs/vmexport.md, "Children"): no client, no clock (time is a parameter). Each function turns
//! plain inputs into plain objects: the export's children (`service`, `token`, `pod`, `manifest`),
//! its links (`links`) and its status (`status`).

pub mod links;
pub mod manifest;
pub mod pod;
pub mod service;
pub mod status;
pub mod token;

use std::collections::BTreeMap;

use super::api::*;

fn app_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(APP_LABEL.to_string(), APP_LABEL_VALUE.to_string())])
}
