//! The signing key's three sources and the `jumpstarter-controller` ConfigMap.

use super::*;

// ---- The three key sources (docs/exporter.md, "The signing key") ----

/// Which of two managers holds leadership (1 or 2, by its metric).
async fn leader_of(a: &Manager, b: &Manager, id: &str) -> usize {
    let start = Instant::now();
    loop {
        let held =
            |text: String| metric(&text, "leader_election_master_status", &[("name", id)]) == 1.0;
        match (held(a.metrics().await), held(b.metrics().await)) {
            (true, false) => return 1,
            (false, true) => return 2,
            _ => {}
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "no single leader within {TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A pass over e1 and c1 on `m`, with nothing to change: their Secrets are left alone.
async fn passes_keep_tokens(m: &Manager, env: &TestEnv, tokens: &(String, String)) {
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let (e, c) = (
        reconciles(m, "exporter").await,
        reconciles(m, "client").await,
    );
    touch(&exporters, "e1").await;
    touch(&secrets, "c1-client").await;
    wait_reconciles(m, "exporter", e).await;
    wait_reconciles(m, "client", c).await;
    assert_eq!(
        (
            token_of(&secrets, "e1-exporter").await.unwrap(),
            token_of(&secrets, "c1-client").await.unwrap()
        ),
        tokens.clone(),
        "same key: the tokens are kept"
    );
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn seed_key_is_shared_by_replicas_and_a_new_seed_remints() {
    let env = TestEnv::new("exp-seed").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let id = unique("ucm-seed");
    let replica = |seed: &str| {
        Manager::start(ManagerOpts {
            env: vec![("CONTROLLER_KEY".into(), seed.into())],
            ..keyless(
                &env,
                &["--leader-elect", &format!("--leader-election-id={id}")],
            )
        })
    };
    // Two replicas with one seed: whichever leads mints, the other derives the same key.
    let a = replica(SEED);
    let b = replica(SEED);
    a.wait_ready().await;
    b.wait_ready().await;
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    let key = SigningKey::from_seed(SEED).unwrap();
    let tokens = tokens_signed_by(&secrets, &key, "tokens signed with the seed's key").await;

    // Hand over: the standby becomes leader, reconciles everything, and keeps the tokens.
    let (mut leader, standby) = match leader_of(&a, &b, &id).await {
        1 => (a, b),
        _ => (b, a),
    };
    leader.signal("TERM");
    leader.wait_exit(Duration::from_secs(30));
    passes_keep_tokens(&standby, &env, &tokens).await;
    drop(standby);

    // A new seed: every token is re-minted in the first pass after the restart.
    let c = replica("a-rotated-seed");
    c.wait_ready().await;
    let rotated = SigningKey::from_seed("a-rotated-seed").unwrap();
    tokens_signed_by(&secrets, &rotated, "tokens re-minted with the new seed").await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn generated_key_is_created_once_shared_and_replaced_when_deleted() {
    let env = TestEnv::new("exp-genkey").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let id = unique("ucm-key");
    let replica = || {
        Manager::start(keyless(
            &env,
            &["--leader-elect", &format!("--leader-election-id={id}")],
        ))
    };
    // Neither CONTROLLER_KEY nor a key Secret: two replicas start together; the leader
    // generates ucm-exporter-signing-key, the standby waits for it and reads it.
    let a = replica();
    let b = replica();
    a.wait_ready().await;
    b.wait_ready().await;
    eventually(TIMEOUT, "the generated key Secret", || async {
        secrets
            .get_opt("ucm-exporter-signing-key")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    let stored = secrets.get("ucm-exporter-signing-key").await.unwrap();
    let pem = String::from_utf8(stored.data.clone().unwrap()["key.pem"].0.clone()).unwrap();
    assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"), "PKCS#8 PEM");
    let generated = SigningKey::from_pkcs8_pem(&pem).unwrap();
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    let tokens =
        tokens_signed_by(&secrets, &generated, "tokens signed with the generated key").await;

    // Hand over: the new leader uses the same stored key, which nobody rewrote.
    let (mut leader, standby) = match leader_of(&a, &b, &id).await {
        1 => (a, b),
        _ => (b, a),
    };
    leader.signal("TERM");
    leader.wait_exit(Duration::from_secs(30));
    passes_keep_tokens(&standby, &env, &tokens).await;
    assert_eq!(
        rv(&secrets.get("ucm-exporter-signing-key").await.unwrap()),
        rv(&stored),
        "generated once, never rewritten"
    );
    drop(standby);

    // Deleting the key Secret: the next leader generates a new key and every token is
    // re-minted with it.
    secrets
        .delete("ucm-exporter-signing-key", &DeleteParams::default())
        .await
        .unwrap();
    let c = replica();
    c.wait_ready().await;
    eventually(TIMEOUT, "a new generated key Secret", || async {
        secrets
            .get_opt("ucm-exporter-signing-key")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    let pem = String::from_utf8(
        secrets
            .get("ucm-exporter-signing-key")
            .await
            .unwrap()
            .data
            .unwrap()["key.pem"]
            .0
            .clone(),
    )
    .unwrap();
    let regenerated = SigningKey::from_pkcs8_pem(&pem).unwrap();
    assert_ne!(regenerated, generated);
    tokens_signed_by(&secrets, &regenerated, "tokens re-minted with the new key").await;
}

fn key_secret(name: &str, pem: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
           "type": "Opaque", "stringData": {"key.pem": pem}})
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn signing_key_from_the_flags_secret() {
    // The exporter and snapshot features run (see common::snapshot_coordinator).
    let _coordinator = snapshot_coordinator().await;
    let env = TestEnv::new("exp-keysecret").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let flag = "--exporter-signing-key-secret=lab-signing-key";
    let start = || Manager::start(with_snapshot_too(keyless(&env, &[flag])));
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;

    // Both sources: refused with the reason.
    let both = Manager::start(ManagerOpts {
        env: vec![("CONTROLLER_KEY".into(), SEED.into())],
        ..keyless(&env, &[flag])
    });
    readyz_503_with(
        &both,
        "both key sources to be refused",
        &["[-]feature-exporter failed: CONTROLLER_KEY and --exporter-signing-key-secret are both set; choose one"],
    )
    .await;
    drop(both);

    // Missing: the exporter feature is not ready and says why; the other feature runs.
    let m = start();
    readyz_503_with(
        &m,
        "the missing key Secret to be reported",
        &[
            "[-]feature-exporter failed: signing key Secret lab-signing-key (--exporter-signing-key-secret) not found",
            "[+]feature-snapshot ok",
        ],
    )
    .await;
    assert!(secrets.get_opt("e1-exporter").await.unwrap().is_none());

    // Invalid (a SEC1 key): reported with a hint, still not ready.
    create(
        &env.client,
        &env.ns,
        key_secret(
            "lab-signing-key",
            "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIA==\n-----END EC PRIVATE KEY-----\n",
        ),
    )
    .await;
    readyz_503_with(
        &m,
        "the invalid key to be reported",
        &[
            "Secret lab-signing-key, key key.pem",
            "openssl pkcs8 -topk8",
        ],
    )
    .await;

    // Fixed: the feature starts by itself and signs with that key.
    let first = SigningKey::generate();
    secrets
        .patch(
            "lab-signing-key",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"key.pem": first.to_pkcs8_pem()}})),
        )
        .await
        .unwrap();
    m.wait_ready().await;
    let tokens = tokens_signed_by(&secrets, &first, "tokens signed with the Secret's key").await;
    let logs = m.logs();
    assert!(
        !logs.contains("PRIVATE KEY") && !logs.contains("eyJ"),
        "no key or token in the logs"
    );
    drop(m);

    // A restart reads the same key: the tokens are kept.
    let m = start();
    m.wait_ready().await;
    passes_keep_tokens(&m, &env, &tokens).await;
    drop(m);

    // A new key in the Secret: every token is re-minted after the restart.
    let second = SigningKey::generate();
    secrets
        .patch(
            "lab-signing-key",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"key.pem": second.to_pkcs8_pem()}})),
        )
        .await
        .unwrap();
    let m = start();
    m.wait_ready().await;
    tokens_signed_by(&secrets, &second, "tokens re-minted with the new key").await;
    eventually(TIMEOUT, "the replacement event", || async {
        events_of(&env.client, &env.ns, "e1")
            .await
            .iter()
            .any(|(reason, note, _)| {
                reason == "CredentialCreated"
                    && note
                        == "Credential token replaced (invalid) for exporter: secret=e1-exporter"
            })
    })
    .await;
}

// ---- The jumpstarter-controller ConfigMap: a custom token lifetime; GRPC_ENDPOINT ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn config_map_sets_the_token_lifetime_and_a_bad_one_is_reported() {
    // The exporter and snapshot features run (see common::snapshot_coordinator).
    let _coordinator = snapshot_coordinator().await;
    let env = TestEnv::new("exp-config").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let clients: Api<JClient> = Api::namespaced(env.client.clone(), &env.ns);
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        config_map(json!({"config": "authentication:\n  internal:\n    tokenLifetme: 2h\n"})),
    )
    .await;
    let m = Manager::start(with_snapshot_too(ManagerOpts {
        env: vec![
            ("CONTROLLER_KEY".into(), SEED.into()),
            ("GRPC_ENDPOINT".into(), "env.e2e:9443".into()),
        ],
        ..keyless(&env, &[])
    }));
    readyz_503_with(
        &m,
        "the invalid ConfigMap to be reported",
        &[
            "[-]feature-exporter failed: ConfigMap jumpstarter-controller, key config:",
            "unknown field `tokenLifetme`",
            "[+]feature-snapshot ok",
        ],
    )
    .await;
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;

    // Fixed (and with the legacy key next to it, which `config` overrides): the feature starts
    // by itself and mints 2-hour tokens.
    cms.patch(
        "jumpstarter-controller",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {
            "config": "authentication:\n  internal:\n    prefix: \"lab:\"\n    tokenLifetime: 2h\n",
            "authentication": "internal:\n  prefix: \"old:\"\n"}})),
    )
    .await
    .unwrap();
    m.wait_ready().await;
    let key = SigningKey::from_seed(SEED).unwrap();
    tokens_signed_by(&secrets, &key, "tokens").await;
    for secret in ["e1-exporter", "c1-client"] {
        let c = valid_claims(&secrets, secret, &key).await.unwrap();
        assert_eq!(c.exp - c.iat, 7200, "{secret}: the ConfigMap's lifetime");
    }
    let c = valid_claims(&secrets, "e1-exporter", &key).await.unwrap();
    let want = (
        "True".to_string(),
        "ExpiresWithin7Days".to_string(),
        format!(
            "Token expires on {} (0 days remaining)",
            rfc3339(Timestamp::from_second(c.exp).unwrap())
        ),
    );
    eventually(TIMEOUT, "the Exporter status", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| exporter_condition(&e, "TokenExpiring"))
            == Some(want.clone())
    })
    .await;
    let e = exporters.get("e1").await.unwrap();
    assert_eq!(
        e.status.unwrap().endpoint.as_deref(),
        Some("env.e2e:9443"),
        "GRPC_ENDPOINT without the flag"
    );
    eventually(TIMEOUT, "TokenExpiringSoon on the Exporter", || async {
        events_of(&env.client, &env.ns, "e1").await.contains(&(
            "TokenExpiringSoon".into(),
            want.2.clone(),
            "Warning".into(),
        ))
    })
    .await;
    let cc = valid_claims(&secrets, "c1-client", &key).await.unwrap();
    eventually(TIMEOUT, "the Client status and event", || async {
        let ok_status = clients.get("c1").await.ok().is_some_and(|c| {
            client_cond(&c, "TokenExpiring").is_some_and(|k| k.reason == "ExpiresWithin7Days")
                && c.status.as_ref().and_then(|s| s.endpoint.as_deref()) == Some("env.e2e:9443")
        });
        ok_status
            && events_of(&env.client, &env.ns, "c1").await.contains(&(
                "TokenExpiringSoon".into(),
                format!(
                    "Token for client c1 is expiring soon: expires={}",
                    rfc3339(Timestamp::from_second(cc.exp).unwrap())
                ),
                "Warning".into(),
            ))
    })
    .await;
    assert!(
        m.logs()
            .contains("the legacy key authentication is ignored"),
        "the ignored legacy key is logged"
    );
}
