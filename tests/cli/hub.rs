//! `--model ORG/NAME` against a local stand-in for the Hugging Face Hub (fake_hub.rs) serving
//! repos made of the tiny fixtures: the download into the Hugging Face cache layout, a cut
//! connection resumed with `Range`, checksums, offline mode, the GGUF tag, sharded weights,
//! `--tokenizer`, gated repos and the errors' one line; and the cache shared with Python's
//! huggingface_hub (both ways), when a python with it is at hand (IRIS_TEST_PYTHON).

use super::fake_hub::{hex, FakeHub, Logged, Repo, RepoFile};
use super::*;

use sha2::{Digest, Sha256};

/// The fixture's files (its reference outputs aside); the weights are served as LFS.
fn tiny_llama_files() -> Vec<RepoFile> {
    [
        "config.json",
        "generation_config.json",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ]
    .into_iter()
    .map(|name| file(name, std::fs::read(fixture("tiny-llama").join(name)).expect("fixture file")))
    .collect()
}

fn file(name: &str, data: Vec<u8>) -> RepoFile {
    let lfs = name.ends_with(".safetensors") || name.ends_with(".gguf");
    RepoFile { name: name.to_string(), data, lfs }
}

fn repo(id: &str, files: Vec<RepoFile>) -> Repo {
    Repo { id: id.to_string(), commit: commit_of(id), files, token: None }
}

/// Each repo's commit id: 40 hex digits of its name's hash.
fn commit_of(id: &str) -> String {
    hex(&Sha256::digest(id.as_bytes()))[..40].to_string()
}

fn sha256_file(p: &Path) -> String {
    hex(&Sha256::digest(std::fs::read(p).expect("read file")))
}

/// iris against `hub`, with `cache` as the Hugging Face cache and a clean HF environment.
fn hub_iris(hub: &FakeHub, cache: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let (mut c, _iris_cache) = iris_cmd(args);
    for v in ["HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE"] {
        c.env_remove(v);
    }
    c.env("HF_ENDPOINT", &hub.url).env("HF_HUB_CACHE", cache).env("HF_HOME", cache.join("home"));
    c.envs(env.iter().copied()).output().expect("run iris")
}

fn ok(out: Output, what: &str) -> String {
    assert_no_panic(&out);
    assert!(out.status.success(), "{what} failed:\n{}", text(&out.stderr));
    text(&out.stdout)
}

/// The requests for files (HEAD/GET of `resolve`, and the CDN), as opposed to the listing.
fn file_requests(log: &[Logged]) -> Vec<String> {
    log.iter()
        .filter(|l| !l.path.starts_with("/api/"))
        .map(|l| format!("{} {} {}", l.server, l.method, l.path))
        .collect()
}

fn cdn_gets(log: &[Logged]) -> Vec<&Logged> {
    log.iter().filter(|l| l.server == "cdn" && l.method == "GET").collect()
}

/// What the local fixture generates, to compare a downloaded copy with.
fn local_generation() -> String {
    stdout_of(&generate_args(fixture("tiny-llama").to_str().unwrap(), &[]))
}

#[test]
fn hub_id_downloads_into_the_hf_cache_and_runs() {
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let cache = TempDir::new("hf-cache");
    let out = ok(hub_iris(&hub, cache.path(), &[], &generate_args("test/tiny-llama", &[])), "generate");
    assert_eq!(out, local_generation(), "the downloaded model generates as the local one");

    // The layout huggingface_hub uses.
    let commit = commit_of("test/tiny-llama");
    let dir = cache.join("models--test--tiny-llama");
    assert_eq!(std::fs::read_to_string(dir.join("refs/main")).unwrap(), commit);
    let snapshot = dir.join("snapshots").join(&commit);
    for f in tiny_llama_files() {
        let link = std::fs::read_link(snapshot.join(&f.name)).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let etag = if f.lfs { f.sha256() } else { f.sha256()[..40].to_string() };
        assert_eq!(link, Path::new("../../blobs").join(&etag), "{}", f.name);
        assert_eq!(sha256_file(&dir.join("blobs").join(&etag)), f.sha256(), "{}", f.name);
    }
    // Optional files the repo lacks are recorded, so a run by commit needs no listing.
    assert!(dir.join(".no_exist").join(&commit).join("model.safetensors.index.json").exists());
    let log = hub.log();
    assert_eq!(log.iter().filter(|l| l.path.starts_with("/api/models/test/tiny-llama/revision/main")).count(), 1);
    let gets = cdn_gets(&log);
    assert_eq!(gets.len(), 1, "{log:?}");
    assert_eq!(gets[0].header("range"), None);

    // Again: only the listing (the revision may have moved); every file is cached.
    hub.clear_log();
    ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-llama"]), "inspect");
    let log = hub.log();
    assert_eq!(log.len(), 1, "{log:?}");
    // By commit, with every file present or known absent: no request at all.
    hub.clear_log();
    let inspect = ["inspect", "--model", "test/tiny-llama", "--revision", &commit];
    let out = ok(hub_iris(&hub, cache.path(), &[], &inspect), "inspect by commit");
    assert!(out.contains(&format!("model:            {}", snapshot.display())), "{out}");
    assert!(hub.log().is_empty(), "{:?}", hub.log());
}

#[test]
fn hub_download_resumes_a_cut_connection_with_range() {
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let weights = tiny_llama_files().pop().unwrap();
    assert!(weights.lfs);
    let cut = 100_000;
    hub.cut_next_get(&weights.sha256(), cut);
    let cache = TempDir::new("hf-cut");
    ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-llama"]), "inspect");
    let log = hub.log();
    let gets = cdn_gets(&log);
    assert_eq!(gets.len(), 2, "one cut GET, one resumed: {:?}", file_requests(&log));
    assert_eq!(gets[0].header("range"), None);
    assert_eq!(gets[1].header("range"), Some(format!("bytes={cut}-").as_str()));
    let blob = cache.join("models--test--tiny-llama/blobs").join(weights.sha256());
    assert_eq!(sha256_file(&blob), weights.sha256());
    assert!(!Path::new(&format!("{}.incomplete", blob.display())).exists());

    // A partial blob left by an earlier run is resumed from its length.
    let cache = TempDir::new("hf-partial");
    let blobs = cache.join("models--test--tiny-llama/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(format!("{}.incomplete", weights.sha256())), &weights.data[..200_000]).unwrap();
    hub.clear_log();
    ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-llama"]), "inspect");
    let log = hub.log();
    let gets = cdn_gets(&log);
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].header("range"), Some("bytes=200000-"));
    assert_eq!(sha256_file(&blobs.join(weights.sha256())), weights.sha256());
}

#[test]
fn hub_download_checks_the_lfs_sha256() {
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let weights = tiny_llama_files().pop().unwrap();
    let cache = TempDir::new("hf-corrupt");
    let blobs = cache.join("models--test--tiny-llama/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let partial = blobs.join(format!("{}.incomplete", weights.sha256()));
    std::fs::write(&partial, vec![0u8; 1000]).unwrap();
    let args = ["inspect", "--model", "test/tiny-llama"];
    let out = hub_iris(&hub, cache.path(), &[], &args);
    // The download's log lines come first; the error is one line, the last.
    assert_no_panic(&out);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!((errors.len(), stderr.lines().last()), (1, errors.first().copied()), "{stderr}");
    for s in ["model.safetensors", "checksum mismatch", &weights.sha256()] {
        assert!(errors[0].contains(s), "{s}: {stderr}");
    }
    assert!(!partial.exists(), "the bad partial download is removed");
    assert!(!blobs.join(weights.sha256()).exists());
    ok(hub_iris(&hub, cache.path(), &[], &args), "the next run");
    assert_eq!(sha256_file(&blobs.join(weights.sha256())), weights.sha256());
}

#[test]
fn hub_offline_uses_only_the_cache() {
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let cache = TempDir::new("hf-offline");
    let offline = [("HF_HUB_OFFLINE", "1")];
    let args = ["inspect", "--model", "test/tiny-llama"];
    let out = hub_iris(&hub, cache.path(), &offline, &args);
    check_error(&out, &args, &["test/tiny-llama", "not in the Hugging Face cache", "HF_HUB_OFFLINE"]);
    assert!(hub.log().is_empty(), "offline: no request");

    ok(hub_iris(&hub, cache.path(), &[], &args), "online");
    hub.clear_log();
    let out = ok(hub_iris(&hub, cache.path(), &offline, &generate_args("test/tiny-llama", &[])), "offline");
    assert_eq!(out, local_generation());
    assert!(hub.log().is_empty(), "offline: no request: {:?}", hub.log());
    // Online with the Hub out of reach: the complete cached snapshot, with a warning.
    let out = hub_iris(&hub, cache.path(), &[("HF_ENDPOINT", "http://127.0.0.1:9")], &args);
    assert!(ok(out.clone(), "unreachable").contains("model:"));
    assert!(
        text(&out.stderr).contains("cannot reach http://127.0.0.1:9")
            && text(&out.stderr).contains("using the cached snapshot")
    );
    // A revision never fetched is a miss.
    let args = ["inspect", "--model", "test/tiny-llama", "--revision", "v2"];
    let out = hub_iris(&hub, cache.path(), &offline, &args);
    check_error(&out, &args, &["revision `v2`", "no snapshot", "HF_HUB_OFFLINE"]);
    // A snapshot without its weights is one too, naming what is missing.
    let commit = commit_of("test/tiny-llama");
    std::fs::remove_file(cache.join(&format!("models--test--tiny-llama/snapshots/{commit}/model.safetensors")))
        .unwrap();
    let args = ["inspect", "--model", "test/tiny-llama"];
    check_error(&hub_iris(&hub, cache.path(), &offline, &args), &args, &["HF_HUB_OFFLINE"]);
}

#[test]
fn hub_gguf_is_chosen_by_tag() {
    let tmp = TempDir::new("hf-gguf-src");
    let (f32_path, q8_path) = (tmp.join("f32.gguf"), tmp.join("q8.gguf"));
    write_tiny_llama_gguf_as(&f32_path, GgmlDType::F32);
    write_tiny_llama_gguf_as(&q8_path, GgmlDType::Q8_0);
    let files = vec![
        file("README.md", b"# tiny".to_vec()),
        file("tiny-llama-F32.gguf", std::fs::read(&f32_path).unwrap()),
        file("tiny-llama-Q8_0.gguf", std::fs::read(&q8_path).unwrap()),
    ];
    let hub = FakeHub::start(vec![repo("test/tiny-gguf", files)]);
    let cache = TempDir::new("hf-gguf");
    let snapshot = cache.join("models--test--tiny-gguf/snapshots").join(commit_of("test/tiny-gguf"));

    let out = ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-gguf:q8_0"]), "tag");
    assert!(out.contains(&format!("model:            {}", snapshot.join("tiny-llama-Q8_0.gguf").display())), "{out}");
    assert!(out.contains("Q8_0"), "{out}");
    let fetched = file_requests(&hub.log());
    assert!(fetched.iter().all(|r| !r.contains("F32") && !r.contains("README")), "only the chosen file: {fetched:?}");

    let by_name = ["inspect", "--model", "test/tiny-gguf", "--gguf-file", "tiny-llama-F32.gguf"];
    let out = ok(hub_iris(&hub, cache.path(), &[], &by_name), "--gguf-file");
    assert!(out.contains("tiny-llama-F32.gguf"), "{out}");
    // Offline, the same tag finds the same file in the snapshot.
    let out = ok(
        hub_iris(&hub, cache.path(), &[("HF_HUB_OFFLINE", "1")], &["inspect", "--model", "test/tiny-gguf:Q8_0"]),
        "offline tag",
    );
    assert!(out.contains("tiny-llama-Q8_0.gguf"), "{out}");

    let cases: [(&[&str], &[&str]); 4] = [
        (
            &["inspect", "--model", "test/tiny-gguf"],
            &["several GGUF files", "tiny-llama-F32.gguf, tiny-llama-Q8_0.gguf", ":TAG"],
        ),
        (
            &["inspect", "--model", "test/tiny-gguf:Q4_K_M"],
            &["no GGUF file matching `Q4_K_M`", "tiny-llama-F32.gguf, tiny-llama-Q8_0.gguf"],
        ),
        (&["inspect", "--model", "test/tiny-gguf:tiny"], &["`test/tiny-gguf:tiny` matches several", "--gguf-file"]),
        (&["inspect", "--model", "test/tiny-gguf:Q8_0", "--gguf-file", "x.gguf"], &["--gguf-file", "give one"]),
    ];
    for (args, must) in cases {
        check_error(&hub_iris(&hub, cache.path(), &[], args), args, must);
    }
}

#[test]
fn hub_sharded_safetensors_fetch_the_index_and_its_shards() {
    let st = candle_core::safetensors::load(fixture("tiny-llama").join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    let tmp = TempDir::new("hf-shards-src");
    let mut weight_map = serde_json::Map::new();
    let mut files: Vec<RepoFile> = tiny_llama_files().into_iter().filter(|f| f.name != "model.safetensors").collect();
    for (i, half) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", i + 1);
        let tensors: HashMap<String, Tensor> = half.iter().map(|n| (n.to_string(), st[*n].clone())).collect();
        candle_core::safetensors::save(&tensors, tmp.join(&shard)).unwrap();
        for n in half {
            weight_map.insert(n.to_string(), serde_json::Value::String(shard.clone()));
        }
        files.push(file(&shard, std::fs::read(tmp.join(&shard)).unwrap()));
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    files.push(file("model.safetensors.index.json", index.to_string().into_bytes()));
    files.push(file("unused.safetensors", b"not named by the index".to_vec()));
    let hub = FakeHub::start(vec![repo("test/tiny-sharded", files)]);
    let cache = TempDir::new("hf-shards");
    let out = ok(hub_iris(&hub, cache.path(), &[], &generate_args("test/tiny-sharded", &[])), "generate");
    assert_eq!(out, local_generation());
    let fetched = file_requests(&hub.log());
    assert_eq!(fetched.iter().filter(|r| r.contains("cdn GET")).count(), 2, "{fetched:?}");
    assert!(fetched.iter().all(|r| !r.contains("unused")), "{fetched:?}");
}

#[test]
fn hub_tokenizer_comes_from_elsewhere() {
    let all = tiny_llama_files();
    let (tok, weights): (Vec<RepoFile>, Vec<RepoFile>) =
        all.into_iter().partition(|f| f.name.starts_with("tokenizer") || f.name == "chat_template.jinja");
    let hub = FakeHub::start(vec![repo("test/weights-only", weights), repo("test/tokenizer", tok)]);
    let cache = TempDir::new("hf-tok");
    let with_tok = generate_args("test/weights-only", &["--tokenizer", "test/tokenizer"]);
    assert_eq!(ok(hub_iris(&hub, cache.path(), &[], &with_tok), "--tokenizer id"), local_generation());
    let local_tok = fixture("tiny-llama");
    let with_dir = generate_args("test/weights-only", &["--tokenizer", local_tok.to_str().unwrap()]);
    assert_eq!(ok(hub_iris(&hub, cache.path(), &[], &with_dir), "--tokenizer dir"), local_generation());
    let args = generate_args("test/weights-only", &[]);
    check_error(&hub_iris(&hub, cache.path(), &[], &args), &args, &["tokenizer.json"]);
    let args = generate_args("test/weights-only", &["--tokenizer", "test/weights-only"]);
    check_error(&hub_iris(&hub, cache.path(), &[], &args), &args, &["`test/weights-only` has no tokenizer.json"]);
    let args = generate_args("test/weights-only", &["--tokenizer", "no/such/dir"]);
    check_error(&hub_iris(&hub, cache.path(), &[], &args), &args, &["--tokenizer no/such/dir", "no such file"]);
}

#[test]
fn hub_gated_repos_need_a_token() {
    let mut gated = repo("test/gated", tiny_llama_files());
    gated.token = Some("hf_secret".into());
    let hub = FakeHub::start(vec![gated]);
    let cache = TempDir::new("hf-gated");
    let args = ["inspect", "--model", "test/gated"];
    let out = hub_iris(&hub, cache.path(), &[], &args);
    check_error(
        &out,
        &args,
        &["`test/gated` is gated", "HTTP 401", "set HF_TOKEN", &format!("{}/test/gated", hub.url)],
    );
    let out = hub_iris(&hub, cache.path(), &[("HF_TOKEN", "hf_other")], &args);
    check_error(&out, &args, &["HTTP 403", "the token from HF_TOKEN has no access", "accept the license"]);

    // The token file under HF_HOME (what `hf auth login` writes).
    std::fs::create_dir_all(cache.join("home")).unwrap();
    std::fs::write(cache.join("home/token"), "hf_secret\n").unwrap();
    hub.clear_log();
    ok(hub_iris(&hub, cache.path(), &[], &args), "with the token file");
    let log = hub.log();
    assert!(log.iter().filter(|l| l.server == "hub").all(|l| l.header("authorization") == Some("Bearer hf_secret")));
    assert!(
        log.iter().filter(|l| l.server == "cdn").all(|l| l.header("authorization").is_none()),
        "no token to the CDN"
    );
}

#[test]
fn hub_errors_are_one_line() {
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let cache = TempDir::new("hf-errors");
    let local = fixture("tiny-llama");
    let local = local.to_str().unwrap();
    let cases: [(&[&str], &[&str]); 7] = [
        (
            &["inspect", "--model", "test/missing"],
            &["`test/missing` is not a local path", "no model `test/missing`", "HTTP 404"],
        ),
        (&["inspect", "--model", "test/tiny-llama", "--revision", "nope"], &["no revision `nope`"]),
        (&["inspect", "--model", local, "--revision", "main"], &["--revision applies to a Hugging Face model id"]),
        (&["inspect", "--model", local, "--gguf-file", "x.gguf"], &["--gguf-file applies"]),
        (&["inspect", "--model", "no/such/dir/model"], &["no/such/dir/model"]),
        (&["inspect", "--tokenizer-revision", "main", "--model", local], &["--tokenizer-revision needs --tokenizer"]),
        (&["serve", "--port", "0", "--model", "test/missing"], &["no model `test/missing`", "HTTP 404"]),
    ];
    for (args, must) in cases {
        check_error(&hub_iris(&hub, cache.path(), &[], args), args, must);
    }
    // An endpoint nobody answers on.
    let args = ["inspect", "--model", "test/tiny-llama"];
    let out = hub_iris(&hub, cache.path(), &[("HF_ENDPOINT", "http://127.0.0.1:9")], &args);
    check_error(&out, &args, &["cannot reach http://127.0.0.1:9", "HF_HUB_OFFLINE"]);
    // An existing path wins over an id of the same spelling.
    let dir = TempDir::new("hf-shadow");
    let shadow = dir.join("test/tiny-llama");
    std::fs::create_dir_all(&shadow).unwrap();
    for f in tiny_llama_files() {
        std::fs::write(shadow.join(&f.name), &f.data).unwrap();
    }
    let (mut c, _c) = iris_cmd(&["inspect", "--model", "test/tiny-llama"]);
    c.current_dir(dir.path()).env("HF_ENDPOINT", "http://127.0.0.1:9");
    let out = ok(c.output().unwrap(), "a local test/tiny-llama");
    assert!(out.contains("model:            test/tiny-llama"), "{out}");
}

/// The huggingface_hub version .ci/run installs.
const PINNED_HUB: &str = "2.4.0";

/// The interpreter with huggingface_hub, or `None` when the test is skipped (said why). Under
/// CI=true a missing one fails, unless .ci/run said why (IRIS_SDK_SKIP_REASON).
fn hub_python() -> Option<String> {
    let py = std::env::var("IRIS_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    // The fake hub answers as the hub does for the version .ci/run pins; other versions ask
    // other things of it (a GPU machine's python failed on a CDN reply without X-Repo-Commit).
    let version = Command::new(&py)
        .args(["-c", "import huggingface_hub; print(huggingface_hub.__version__)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o.stdout).trim().to_string());
    if version.as_deref() == Some(PINNED_HUB) {
        return Some(py);
    }
    let msg = match version {
        Some(v) => format!("{py} has huggingface_hub {v}, not {PINNED_HUB} (.ci/run's): set IRIS_TEST_PYTHON"),
        None => format!("{py} has no huggingface_hub: set IRIS_TEST_PYTHON to a python that has it (.ci/run does)"),
    };
    if let Ok(reason) = std::env::var("IRIS_SDK_SKIP_REASON") {
        eprintln!("skipped: {reason}");
        return None;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}");
    }
    eprintln!("skipped: {msg}");
    None
}

fn python_hub(py: &str, hub: &FakeHub, cache: &Path, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_hub_cache.py");
    let mut c = Command::new(py);
    for v in ["HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "HF_XET_HIGH_PERFORMANCE"] {
        c.env_remove(v);
    }
    let out = c
        .arg(&script)
        .args(args)
        .env("HF_ENDPOINT", &hub.url)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("home"))
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{} {args:?} failed:\n{}", script.display(), text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn hub_cache_is_shared_with_python_huggingface_hub() {
    let Some(py) = hub_python() else { return };
    let hub = FakeHub::start(vec![repo("test/tiny-llama", tiny_llama_files())]);
    let names: Vec<String> = tiny_llama_files().iter().map(|f| f.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let commit = commit_of("test/tiny-llama");

    // Python downloads (and looks up the optional files the repo lacks, as transformers does);
    // iris then finds everything in the cache.
    let cache = TempDir::new("hf-py-first");
    let mut args = vec!["download", "test/tiny-llama"];
    args.extend(&names);
    args.extend(["--absent", "chat_template.json", "preprocessor_config.json", "model.safetensors.index.json"]);
    python_hub(&py, &hub, cache.path(), &args);
    assert!(!cdn_gets(&hub.log()).is_empty(), "python downloaded through the fake hub");
    hub.clear_log();
    let out =
        ok(hub_iris(&hub, cache.path(), &[("HF_HUB_OFFLINE", "1")], &generate_args("test/tiny-llama", &[])), "offline");
    assert_eq!(out, local_generation());
    let by_commit = generate_args("test/tiny-llama", &["--revision", &commit]);
    assert_eq!(ok(hub_iris(&hub, cache.path(), &[], &by_commit), "by commit"), local_generation());
    assert!(hub.log().is_empty(), "no request reaches the server: {:?}", hub.log());
    ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-llama"]), "online");
    let log = hub.log();
    assert_eq!(log.len(), 1, "only the revision's listing, no file: {:?}", file_requests(&log));

    // iris downloads; Python finds every file with local_files_only and sees a sound cache.
    let cache = TempDir::new("hf-iris-first");
    ok(hub_iris(&hub, cache.path(), &[], &["inspect", "--model", "test/tiny-llama"]), "download");
    hub.clear_log();
    let mut args = vec!["check", "test/tiny-llama"];
    args.extend(&names);
    let out = python_hub(&py, &hub, cache.path(), &args);
    let json: serde_json::Value = serde_json::from_str(out.trim()).expect("the script prints JSON");
    for f in tiny_llama_files() {
        assert_eq!(json["sha256"][&f.name], f.sha256(), "{}", f.name);
    }
    assert!(hub.log().is_empty(), "local_files_only makes no request: {:?}", hub.log());
    eprintln!("huggingface_hub {}", json["version"]);
}
