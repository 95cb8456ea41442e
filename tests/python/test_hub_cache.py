"""Python's huggingface_hub and iris share one Hugging Face cache (tests/cli/hub.rs runs this).

    test_hub_cache.py download REPO FILE... [--absent FILE...]
        fetches each FILE with hf_hub_download from HF_ENDPOINT into HF_HUB_CACHE, and asks for
        each --absent FILE, which the repo lacks (huggingface_hub records that in .no_exist, as
        transformers' lookups of optional files do).
    test_hub_cache.py check REPO FILE...
        finds each FILE with local_files_only=True (no request) and prints {file: sha256} as
        JSON; scan_cache_dir() must see the repo with no warnings (a well-formed cache).
"""

import hashlib
import json
import sys

import huggingface_hub
from huggingface_hub import hf_hub_download, scan_cache_dir
from huggingface_hub.errors import EntryNotFoundError


def main() -> None:
    mode, repo, *rest = sys.argv[1:]
    files, absent = rest, []
    if "--absent" in rest:
        i = rest.index("--absent")
        files, absent = rest[:i], rest[i + 1 :]
    if mode == "download":
        for f in files:
            hf_hub_download(repo, f)
        for f in absent:
            try:
                hf_hub_download(repo, f)
            except EntryNotFoundError:
                continue
            raise SystemExit(f"{f} should be absent from {repo}")
        return
    assert mode == "check", mode
    sums = {}
    for f in files:
        path = hf_hub_download(repo, f, local_files_only=True)
        with open(path, "rb") as fh:
            sums[f] = hashlib.sha256(fh.read()).hexdigest()
    info = scan_cache_dir()
    assert not info.warnings, [str(w) for w in info.warnings]
    repos = [r for r in info.repos if r.repo_id == repo]
    assert len(repos) == 1, [r.repo_id for r in info.repos]
    assert repos[0].refs.get("main") is not None, "refs/main"
    print(json.dumps({"version": huggingface_hub.__version__, "sha256": sums}))


if __name__ == "__main__":
    main()
