#!/usr/bin/env bash
# Apply (or check, or drop) elastor's Megatron-LM patches: patches/megatron-lm/*.patch.
#
# usage: patches/apply.sh [--check|--reverse] MEGATRON_LM_DIR
#   (default)  check every patch, then apply them all (nothing is applied if one does not fit)
#   --check    only check that every patch applies (git apply --check / patch --dry-run)
#   --reverse  drop the patches again (the stock Megatron-LM comes back)
#
# The patches are pinned to NVIDIA/Megatron-LM tag core_v0.16.1 (commit 55ac708, megatron-core
# 0.16.1); the target's megatron/core/package_info.py must say 0.16.1. Works on a git checkout
# (git apply) or a plain source tree (patch -p1). Never fetches anything.
set -euo pipefail

PINNED_VERSION="0.16.1"
PINNED_TAG="core_v0.16.1"
PINNED_COMMIT="55ac7082517c3878ae653c07c09c534b8aed49f6"

mode=apply
case "${1:-}" in
  --check) mode=check; shift ;;
  --reverse) mode=reverse; shift ;;
esac
if [ $# -ne 1 ]; then
  echo "usage: $0 [--check|--reverse] MEGATRON_LM_DIR" >&2
  exit 2
fi
dir=$(cd "$1" 2>/dev/null && pwd) || { echo "apply.sh: $1: no such directory" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patches=("$here"/megatron-lm/*.patch)

die() { echo "apply.sh: $*" >&2; exit 1; }

# 1. the target is the pinned release
info="$dir/megatron/core/package_info.py"
[ -f "$info" ] || die "$dir is not a Megatron-LM source tree (no megatron/core/package_info.py)"
for f in pretrain_gpt.py megatron/training/checkpointing.py megatron/training/arguments.py \
         megatron/training/initialize.py megatron/training/async_utils.py megatron/training/yaml_arguments.py \
         megatron/training/training.py; do
  [ -f "$dir/$f" ] || die "$dir has no $f: not a Megatron-LM checkout (megatron-core alone is not enough)"
done
ver=$(python3 - "$info" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
print(".".join(re.search(rf"^{k}\s*=\s*(\d+)", s, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH")))
PY
) || die "cannot read the version from $info"
[ "$ver" = "$PINNED_VERSION" ] || die "$dir is megatron-core $ver; these patches are for $PINNED_VERSION \
(Megatron-LM tag $PINNED_TAG). Check out that tag, or port the patches (see patches/README.md)"
use_git=0
if git -C "$dir" rev-parse --is-inside-work-tree >/dev/null 2>&1 && \
   [ "$(git -C "$dir" rev-parse --show-toplevel)" = "$dir" ]; then
  use_git=1
  head=$(git -C "$dir" rev-parse HEAD 2>/dev/null || echo none)
  [ "$head" = "$PINNED_COMMIT" ] || echo "apply.sh: note: HEAD is $head, not $PINNED_TAG ($PINNED_COMMIT); checking the patches anyway" >&2
fi

fits() {  # fits PATCH [reverse]: does it apply (or, reversed, is it applied)?
  local p=$1 rev=${2:-}
  if [ $use_git = 1 ]; then
    git -C "$dir" apply --check ${rev:+--reverse} "$p" 2>/dev/null
  else
    # --forward --fuzz=0: an applied patch must not "fit" again with fuzz (it would leave a .rej);
    # --no-backup-if-mismatch: a hunk placed at an offset (lines moved above it) leaves no *.orig behind
    patch -p1 --dry-run --forward --fuzz=0 --no-backup-if-mismatch --silent ${rev:+--reverse} -d "$dir" < "$p" >/dev/null 2>&1
  fi
}
run() {
  local p=$1 rev=${2:-}
  if [ $use_git = 1 ]; then git -C "$dir" apply ${rev:+--reverse} "$p"
  else patch -p1 --forward --fuzz=0 --no-backup-if-mismatch --silent ${rev:+--reverse} -d "$dir" < "$p"; fi
}

# 2. check every patch first; 3. then apply (or reverse) them all
todo=()
for p in "${patches[@]}"; do
  name=$(basename "$p")
  if [ $mode = reverse ]; then
    if fits "$p" reverse; then todo+=("$p"); else die "$name is not applied to $dir (or the file changed since)"; fi
  elif fits "$p"; then
    todo+=("$p"); echo "ok       $name"
  elif fits "$p" reverse; then
    echo "applied  $name (already)"
  else
    f=$(sed -n 's|^+++ b/||p' "$p" | head -n 1)
    link=""; part=$dir   # never written through (git apply and patch refuse it too): it may point anywhere
    IFS=/ read -ra comps <<< "$f"
    for c in "${comps[@]}"; do part="$part/$c"; if [ -L "$part" ]; then link=$part; break; fi; done
    if [ -n "$link" ]; then
      die "$name: $link is a symbolic link; apply.sh patches regular files in real folders only (put the file or \
folder itself there). Nothing was changed."
    fi
    if grep -q "elastor" "$dir/$f" 2>/dev/null; then   # patched by another elastor_ds version's patch
      restore="restore it ($([ $use_git = 1 ] && echo "git -C '$dir' checkout -- $f" || echo "a fresh copy at $PINNED_TAG"))"
      die "$name does not apply to $dir: its $f holds another version of this patch (from an earlier or later \
elastor_ds). Drop that version with its own apply.sh --reverse, or $restore, then rerun. Nothing was changed."
    fi
    die "$name does not apply to $dir: the file differs from $PINNED_TAG. Nothing was changed."
  fi
done
[ $mode = check ] && { echo "apply.sh: all ${#patches[@]} patches fit $dir"; exit 0; }
# 3a. every file to change (and its folder: git apply and patch write a new file beside it) is writable;
# a fitting patch says nothing about that, and a tree only partly writable would be left half patched
for p in "${todo[@]}"; do
  while IFS= read -r f; do
    d=$(dirname "$dir/$f")
    if [ ! -w "$dir/$f" ] || [ ! -w "$d" ]; then
      die "$dir/$f (or its folder) is not writable by $(id -un 2>/dev/null || id -u): nothing was changed. \
Make the tree writable (or patch a copy of it) and rerun"
    fi
  done < <(sed -n 's|^+++ b/||p' "$p")
done
rollback() {  # undo the patches of this run already applied, newest first, after one failed
  local i
  for ((i = ${#done_[@]} - 1; i >= 0; i--)); do
    if [ $mode = reverse ]; then run "${done_[$i]}" >/dev/null 2>&1 || return 1
    else run "${done_[$i]}" reverse >/dev/null 2>&1 || return 1; fi
  done
}
done_=()
for p in "${todo[@]}"; do
  if [ $mode = reverse ]; then run "$p" reverse || { rollback && \
      die "dropping $(basename "$p") failed (above); the ${#done_[@]} dropped before it were applied again: nothing was changed" \
      || die "dropping $(basename "$p") failed and putting back the ${#done_[@]} before it failed too: rerun apply.sh on a fresh checkout"; }
    echo "dropped  $(basename "$p")"
  else run "$p" || { rollback && \
      die "applying $(basename "$p") failed (above); the ${#done_[@]} applied before it were dropped again: nothing was changed" \
      || die "applying $(basename "$p") failed and dropping the ${#done_[@]} before it failed too: rerun apply.sh on a fresh checkout"; }
    echo "applied  $(basename "$p")"; fi
  done_+=("$p")
done
if [ $mode = reverse ]; then echo "apply.sh: ${#todo[@]} patches dropped from $dir"
else echo "apply.sh: ${#todo[@]} patches applied to $dir; the elastor path is on only with --elastor"; fi
