#!/usr/bin/env bash
# Unpack the patched-vLLM runtime that `make vllm-runtime` wrote (parts + manifest.json) on a GPU machine.
#
# usage: build/vllm-runtime-unpack.sh [--stage DIR] [--no-import-check] [--skip-optional] PARTS_DIR DEST
#
#   PARTS_DIR  where this call's parts are (e.g. .carry/vllm-runtime of the repository copy); manifest.json
#              is read from there, or from the --stage folder when this call did not carry it
#   DEST       the runtime folder: DEST/site (PYTHONPATH), DEST/build/pins, DEST/env.sh
#   --stage DIR  parts may arrive over several calls: each part found in PARTS_DIR is checked against the
#              manifest and moved to DIR (a folder that outlives the call, e.g. /root/zd-parts); once every
#              part of the required set (and of any optional set begun) is in DIR, they are assembled and
#              unpacked. Until then it prints what is still missing and exits 0.
#   --skip-optional  unpack only the required set even if optional parts are present
#   --no-import-check  do not run `import torch, vllm, zerodiff` at the end
#
# Every part is checked (size and sha256) against the manifest; a missing or corrupt part is an error that
# names it (exit 1), and so is an assembled archive whose sha256 is not the manifest's. A DEST that holds
# exactly this runtime already is left as it is. DEST/env.sh (source it) sets the manifest's environment:
# PYTHONPATH=DEST/site, VLLM_USE_FLASHINFER_SAMPLER=0, CUDA_HOME (default /usr/local/cuda), ZERODIFF_PINS.
# At the end it reports, for every zerodiff patch, whether its files in DEST are as the series left them, and
# the versions `import vllm` / `import torch` give. A failed import check exits 3 (the files stay unpacked).
# Needs bash, coreutils, tar, python3 (PYTHON=... to pick another); xz, or Python's lzma when xz is absent.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
STAGE="" IMPORT_CHECK=1 SKIP_OPTIONAL=0
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --stage) [[ $# -ge 2 ]] || { echo "ERROR: --stage needs a folder" >&2; exit 2; }; STAGE="$2"; shift 2 ;;
        --stage=*) STAGE="${1#--stage=}"; shift ;;
        --no-import-check) IMPORT_CHECK=0; shift ;;
        --skip-optional) SKIP_OPTIONAL=1; shift ;;
        -*) echo "ERROR: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
[[ ${#args[@]} -eq 2 ]] || { echo "ERROR: expected PARTS_DIR DEST (see --help)" >&2; exit 2; }
PARTS="${args[0]}" DEST="${args[1]}"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "ERROR: $PY not found (set PYTHON=...)" >&2; exit 2; }
say() { echo "[vllm-runtime] $*"; }
die() { echo "ERROR: $*" >&2; exit 1; }
t0=$(date +%s)

# ------------------------------------------------------------------------------------------------ manifest
MANIFEST=""
[[ -f "$PARTS/manifest.json" ]] && MANIFEST="$PARTS/manifest.json"
if [[ -n "$STAGE" ]]; then
    mkdir -p "$STAGE"
    if [[ -n "$MANIFEST" ]]; then
        if [[ -f "$STAGE/manifest.json" ]] && ! cmp -s "$MANIFEST" "$STAGE/manifest.json"; then
            say "the carried manifest.json is another build than the staged one: dropping the staged parts"
            find "$STAGE" -maxdepth 1 -type f -name 'vllm-runtime-*.part*' -delete
        fi
        cp "$MANIFEST" "$STAGE/manifest.json.tmp" && mv "$STAGE/manifest.json.tmp" "$STAGE/manifest.json"
    fi
    MANIFEST="$STAGE/manifest.json"
fi
[[ -f "$MANIFEST" ]] || die "no manifest.json in $PARTS${STAGE:+ or $STAGE}: carry .carry/vllm-runtime/manifest.json with the parts"

# one line per part: SET REQUIRED NAME BYTES SHA256
mf_parts() {
    "$PY" - "$MANIFEST" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
for s in m["sets"]:
    for p in s["parts"]:
        print(s["name"], int(s["required"]), p["name"], p["bytes"], p["sha256"])
EOF
}
# one line per set: SET REQUIRED ARCHIVE_SHA256 ARCHIVE_BYTES NPARTS
mf_sets() {
    "$PY" - "$MANIFEST" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
for s in m["sets"]:
    print(s["name"], int(s["required"]), s["sha256"], s["bytes"], len(s["parts"]))
EOF
}
PART_LINES="$(mf_parts)" || die "$MANIFEST is not a readable runtime manifest"
SET_LINES="$(mf_sets)"
BUILD_ID="$(sha256sum "$MANIFEST" | cut -d' ' -f1)"
say "manifest: $("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); print("vLLM", m["vllm_version"], "wheel", m["vllm_wheel_sha256"][:12], "zerodiff", (m["zerodiff_commit"] or "?")[:12], "+dirty" if m["zerodiff_dirty"] else "")' "$MANIFEST")"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
# check_part FILE NAME BYTES SHA: 0 ok; dies naming the part when it is corrupt
check_part() {
    local f="$1" name="$2" bytes="$3" sha="$4" have got
    have=$(stat -c %s "$f")
    [[ "$have" == "$bytes" ]] || die "part $name is corrupt: $have bytes, the manifest says $bytes ($f)"
    got=$(sha256sum "$f" | cut -d' ' -f1)
    [[ "$got" == "$sha" ]] || die "part $name is corrupt: sha256 $got, the manifest says $sha ($f)"
}

# ------------------------------------------------------------------------------------------------ staging
SRC="$PARTS"
if [[ -n "$STAGE" ]]; then
    moved=0
    while read -r set req name bytes sha; do
        if [[ -f "$PARTS/$name" ]]; then
            check_part "$PARTS/$name" "$name" "$bytes" "$sha"
            mv -f "$PARTS/$name" "$STAGE/$name"
            say "staged $name ($(mib "$bytes")) in $STAGE"
            moved=$((moved + 1))
        fi
    done <<< "$PART_LINES"
    [[ $moved -gt 0 ]] || say "no new parts in $PARTS this call"
    SRC="$STAGE"
fi

# which sets are complete; the required one must be, an optional one is unpacked when complete
declare -A have_n total_n
missing_req=() missing_opt=() started_opt=()
while read -r set req name bytes sha; do
    total_n[$set]=$(( ${total_n[$set]:-0} + 1 ))
    if [[ -f "$SRC/$name" ]]; then
        have_n[$set]=$(( ${have_n[$set]:-0} + 1 ))
    elif [[ $req == 1 ]]; then missing_req+=("$name")
    else missing_opt+=("$set:$name")
    fi
done <<< "$PART_LINES"
want_sets=()
while read -r set req sha bytes n; do
    h=${have_n[$set]:-0}
    say "set $set$([[ $req == 1 ]] || echo ' (optional)'): $h/$n part(s) present"
    if [[ $req == 1 ]]; then want_sets+=("$set")
    elif [[ $SKIP_OPTIONAL == 0 && $h -gt 0 ]]; then want_sets+=("$set"); started_opt+=("$set")
    fi
done <<< "$SET_LINES"
incomplete=("${missing_req[@]}")
for m in "${missing_opt[@]}"; do
    for s in "${started_opt[@]}"; do [[ "${m%%:*}" == "$s" ]] && incomplete+=("${m#*:}"); done
done
if [[ ${#incomplete[@]} -gt 0 ]]; then
    if [[ -n "$STAGE" ]]; then
        say "STAGED, NOT COMPLETE: still missing ${incomplete[*]}; carry them in the next call (same --stage $STAGE)"
        exit 0
    fi
    die "missing part(s) in $SRC: ${incomplete[*]}"
fi

# ------------------------------------------------------------------------------------------------ unpack
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
STAMP="$DEST/.vllm-runtime-build"
done_sets="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$done_sets" == "$BUILD_ID ${want_sets[*]}" && -d "$DEST/site" ]]; then
    say "$DEST already holds this runtime (${want_sets[*]}): not unpacked again"
else
    if [[ -n "$(ls -A "$DEST")" && ! -f "$STAMP" ]]; then
        die "$DEST is not empty and was not made by this script: give an empty or new folder"
    fi
    rm -rf "$DEST/site" "$DEST/build" "$DEST/env.sh" "$DEST/manifest.json" "$STAMP"
    if command -v xz >/dev/null; then unxz() { xz -dc -T0; }
    else unxz() { "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 20)'; }
    fi
    for set in "${want_sets[@]}"; do
        files=()
        while read -r s req name bytes sha; do
            [[ "$s" == "$set" ]] || continue
            say "checking $name ($(mib "$bytes"))"
            check_part "$SRC/$name" "$name" "$bytes" "$sha"
            files+=("$SRC/$name")
        done <<< "$PART_LINES"
        read -r _ _ want_sha want_bytes _ <<< "$(grep "^$set " <<< "$SET_LINES")"
        got_sha=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
        [[ "$got_sha" == "$want_sha" ]] || die "the assembled archive of set $set has sha256 $got_sha, the manifest says $want_sha"
        say "unpacking set $set (${#files[@]} part(s), $(mib "$want_bytes")) into $DEST"
        s0=$(date +%s)
        cat "${files[@]}" | unxz | tar -x -C "$DEST" -f -
        say "  set $set unpacked in $(( $(date +%s) - s0 )) s"
    done
    cp "$MANIFEST" "$DEST/manifest.json"
    "$PY" - "$MANIFEST" "$DEST" > "$DEST/env.sh" <<'EOF'
import json, shlex, sys
m, dest = json.load(open(sys.argv[1])), sys.argv[2]
print(f"# written by build/vllm-runtime-unpack.sh: the environment of the patched vLLM {m['vllm_version']} runtime in {dest}")
for e in m["env"]:
    name, value = e["name"], e["value"].replace("{DEST}", dest)
    print(f"# {e['why']}")
    if e["mode"] == "prepend":
        print(f'export {name}={shlex.quote(value)}"${{{name}:+:${name}}}"')
    elif e["mode"] == "default":
        print(f'export {name}="${{{name}:-{value}}}"')
    else:
        print(f"export {name}={shlex.quote(value)}")
EOF
    echo "$BUILD_ID ${want_sets[*]}" > "$STAMP"
    say "wrote $DEST/env.sh"
fi
[[ -n "$STAGE" ]] && say "(the parts stay in $STAGE; remove them when done)"

# ------------------------------------------------------------------------------------------------ report
say "zerodiff patches in $DEST/site:"
"$PY" - "$MANIFEST" "$DEST" <<'EOF' || die "the patched vLLM files in $DEST/site are not the ones the manifest names"
import hashlib, json, os, sys
m, dest = json.load(open(sys.argv[1])), sys.argv[2]
bad = 0
def sha(p):
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
for p in m["patches"]:
    states = []
    for f in p["files"]:
        path = os.path.join(dest, "site", f)
        if not os.path.isfile(path):
            states.append(f"{f} missing")
        elif sha(path) != m["patched_files"]["site/" + f]:
            states.append(f"{f} differs")
    marker = all(b"zerodiff" in open(os.path.join(dest, "site", f), "rb").read().lower()
                 for f in p["files"] if os.path.isfile(os.path.join(dest, "site", f)))
    if states:
        bad += 1
    print(f"  {p['name']}: " + ("; ".join(states) if states else
          f"in the tree ({len(p['files'])} file(s) as the series left them{', zerodiff marker found' if marker else ''})"))
sys.exit(1 if bad else 0)
EOF
if [[ $IMPORT_CHECK == 1 ]]; then
    say "import check (PYTHONPATH=$DEST/site, $PY):"
    if ! (set +u; . "$DEST/env.sh"; "$PY" - <<'EOF'
import sys, time
t = time.time()
import torch
print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})")
import zerodiff
print(f"  zerodiff {zerodiff.__version__} from {zerodiff.__file__}")
import vllm
print(f"  vllm {vllm.__version__} from {vllm.__file__} ({time.time() - t:.1f} s)")
EOF
    ); then
        echo "IMPORT CHECK FAILED: the runtime is unpacked in $DEST, but \`import vllm\` (or torch / zerodiff) failed" \
             "above. On a machine without the box's CUDA torch this is expected; --no-import-check skips the check." >&2
        exit 3
    fi
fi
say "done in $(( $(date +%s) - t0 )) s: \`. $DEST/env.sh\` and run"
