//! Small helpers over the kube client: create many objects with bounded concurrency, and a
//! watch-based tracker that records the instant the N-th object reached its final state.

use std::collections::HashSet;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// The bench's own concurrency for creating (and, in the references, patching) objects.
pub const CONCURRENCY: usize = 8;

pub async fn create_all<K>(api: &Api<K>, objs: Vec<K>)
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug + Send + Sync + 'static,
{
    futures::stream::iter(objs)
        .for_each_concurrent(CONCURRENCY, |o| {
            let api = api.clone();
            async move {
                let mut tries = 0;
                loop {
                    match api.create(&PostParams::default(), &o).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => break,
                        Err(e) if tries < 5 => {
                            tries += 1;
                            eprintln!("create {}: {e}; retrying", o.name_any());
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => panic!("create {}: {e}", o.name_any()),
                    }
                }
            }
        })
        .await;
}

/// The objects a watch lists or changes, in its order. An error is logged (`what` names the
/// watch) and the watch goes on after 200 ms; the watcher re-lists by itself.
pub fn applied<K>(
    api: Api<K>,
    cfg: watcher::Config,
    what: &'static str,
) -> impl futures::Stream<Item = K> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher(api, cfg).filter_map(move |ev| async move {
        match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => Some(o),
            Ok(_) => None,
            Err(e) => {
                eprintln!("  {what} watch: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
        }
    })
}

/// Watches `api` and counts the objects for which `done` holds; `reached` is the instant the
/// count first reached `n`.
pub struct Tracker {
    count: watch::Receiver<usize>,
    reached: watch::Receiver<Option<Instant>>,
    task: tokio::task::JoinHandle<()>,
    n: usize,
}

pub fn track<K>(api: Api<K>, cfg: watcher::Config, n: usize, done: fn(&K) -> bool) -> Tracker
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (count_tx, count) = watch::channel(0usize);
    let (reached_tx, reached) = watch::channel(None);
    let task = tokio::spawn(async move {
        let mut seen: HashSet<String> = HashSet::new();
        let mut stream = watcher(api, cfg).boxed();
        while let Some(ev) = stream.next().await {
            let obj = match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                Ok(watcher::Event::Delete(o)) => {
                    seen.remove(&key(&o));
                    continue;
                }
                Ok(_) => continue,
                Err(e) => {
                    eprintln!("tracker watch: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if done(&obj) {
                seen.insert(key(&obj));
            } else {
                seen.remove(&key(&obj));
            }
            let _ = count_tx.send(seen.len());
            if seen.len() >= n && reached_tx.borrow().is_none() {
                let _ = reached_tx.send(Some(Instant::now()));
            }
        }
    });
    Tracker {
        count,
        reached,
        task,
        n,
    }
}

fn key<K: Resource>(o: &K) -> String {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

impl Tracker {
    /// How many objects must be done.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Waits until `n` objects are done; panics with the progress after `timeout`.
    pub async fn wait(mut self, what: &str, timeout: Duration) -> Instant {
        let start = Instant::now();
        loop {
            if let Some(t) = *self.reached.borrow() {
                self.task.abort();
                return t;
            }
            if start.elapsed() > timeout {
                panic!(
                    "{what}: only {} of {} done after {timeout:?}",
                    *self.count.borrow(),
                    self.n
                );
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), self.reached.changed()).await;
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn create_namespace(client: &Client, name: &str) {
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    let api: Api<Namespace> = Api::all(client.clone());
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create namespace {name}: {e}"),
    }
}

/// Deletes the namespace and waits until the API server has removed it (and its contents).
pub async fn delete_namespace(client: &Client, name: &str, timeout: Duration) {
    let api: Api<Namespace> = Api::all(client.clone());
    let _ = api.delete(name, &DeleteParams::background()).await;
    wait_gone(&api, name, timeout).await;
}

pub async fn wait_gone<K>(api: &Api<K>, name: &str, timeout: Duration)
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let start = Instant::now();
    while api.get_opt(name).await.ok().flatten().is_some() {
        assert!(
            start.elapsed() < timeout,
            "{name} still exists after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Lists every object of `api` page by page (as the manager's watches do), returning the count.
pub async fn list_all<K>(api: &Api<K>) -> usize
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    // kube's page size, as the manager's watches list.
    let mut lp = ListParams::default().limit(500);
    let mut n = 0;
    loop {
        let page = api.list(&lp).await.unwrap();
        n += page.items.len();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => return n,
        }
    }
}

#[allow(dead_code)]
pub async fn names<K>(api: &Api<K>) -> Vec<String>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    api.list_metadata(&ListParams::default())
        .await
        .map(|l| l.items.into_iter().map(|o| o.name_any()).collect())
        .unwrap_or_default()
}
