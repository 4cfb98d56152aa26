"""python scripts/copy_checkout.py DIR: brings the copy DIR of this git checkout up to date with the
working tree (tracked files and untracked ones that are not ignored, as git lists them), for a build
against another torch that must not overwrite the in-place one (scripts/setup_env.sh). Only files
whose content differs are written (so ninja recompiles only what changed); files the tree no longer
has are deleted from the copy. Run from the checkout's root."""
import filecmp
import os
import shutil
import subprocess
import sys

MANIFEST = ".copied_files"  # in the copy: what the last run copied, NUL-separated


def main(copy: str):
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True, text=True).stdout.split("\0")
    files = {name for name in listed if name and os.path.isfile(name)}  # a deleted tracked file is listed
    manifest = os.path.join(copy, MANIFEST)
    copied = set()
    if os.path.exists(manifest):
        with open(manifest) as f:
            copied = set(f.read().split("\0")) - {""}
    for name in copied - files:
        if os.path.lexists(os.path.join(copy, name)):
            os.remove(os.path.join(copy, name))
    for name in files:
        target = os.path.join(copy, name)
        if not (os.path.isfile(target) and filecmp.cmp(name, target, shallow=False)):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(name, target)
    with open(manifest, "w") as f:
        f.write("\0".join(sorted(files)))


if __name__ == "__main__":
    main(sys.argv[1])
