#!/bin/bash
# Rows of a reproduction on a borrowed accelerator machine that reaches no network and takes at
# most 64 MiB with each command (the workplace's `device` tool: a copy of this working tree plus
# the git-ignored paths a call names in `carry`). Its image has PyTorch, numpy, scipy,
# scikit-learn, matplotlib, safetensors and tqdm, not pydantic: `stage` packs its wheels.
#
#   here:  reproductions/device.sh stage DATA_DIR DATASET...
#            splits DATA_DIR/DATASET (with SHA256SUMS) and the missing wheels into parts
#            .devdata/1, .devdata/2, ... that each fit one call beside the working tree
#   there: one call per part, each within the machine's warm time after the last:
#            carry [".devdata/K"]      command: bash reproductions/device.sh load .devdata/K
#          the last part's call goes on (carry the table's run directories too to resume them):
#            ... && bash reproductions/device.sh run TABLE ROWS SECONDS [--rerun]
#            runs `stocfl reproduce TABLE --rows R [--rerun]` for each row R of ROWS (1-3,5), side by side
#            (run.device = auto picks CUDA), stops them at their last checkpoint after SECONDS,
#            and leaves one $OUT/RUN.tgz per run directory
#   here:  reproductions/device.sh unpack FILES_AT TABLE
#            puts those run directories into reproductions/runs/ and writes the table
#
# A stopped run resumes from its directory: on this machine, or on a device machine again when
# the call carries reproductions/runs/TABLE.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD

usage() { echo "usage: reproductions/device.sh stage DATA_DIR DATASET... | load PART | run TABLE ROWS SECONDS [--rerun] | unpack FILES_AT TABLE" >&2; exit 2; }

# Bytes a part may hold: the call's 64 MiB less the tracked tree and 4 MiB of slack.
part_budget() {
    local tree
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    echo $(( 64 * 1024 * 1024 - tree - 4 * 1024 * 1024 ))
}

stage() {
    local data=$1; shift
    [ $# -ge 1 ] || usage
    [ -f "$data/SHA256SUMS" ] || { echo "device.sh: $data/SHA256SUMS not found: give the data directory (e.g. ../shared/data)" >&2; exit 2; }
    local py=.venv/bin/python budget part=1 used=0 size f pkg
    [ -x $py ] || { echo "device.sh: .venv missing: run 'make setup' first" >&2; exit 2; }
    budget=$(part_budget)
    rm -rf .devdata && mkdir -p .devdata/1/whl .devdata/1/data
    for pkg in pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
        $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .devdata/1/whl "$pkg==$($py -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")"
    done
    used=$(du -sb .devdata/1 | cut -f1)
    cp "$data/SHA256SUMS" .devdata/1/data/
    for name in "$@"; do
        [ -d "$data/$name" ] || { echo "device.sh: no data set $data/$name" >&2; exit 2; }
        for f in "$data/$name"/*; do
            size=$(stat -c %s "$f")
            if [ $(( used + size )) -gt "$budget" ]; then
                part=$((part + 1)); used=0
            fi
            mkdir -p ".devdata/$part/data/$name"
            cp "$f" ".devdata/$part/data/$name/"
            used=$((used + size))
        done
    done
    echo "staged $part part(s) of at most $budget bytes:"
    du -sh .devdata/*
}

load() {
    local src=$1
    [ -d "$src" ] || { echo "device.sh: $src did not travel: name it in the call's carry" >&2; exit 2; }
    mkdir -p .devdata/data
    cp -r "$src/data/." .devdata/data/
    if [ -d "$src/whl" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .devdata/site "$src"/whl/*.whl
    fi
    echo "loaded $src: $(du -sh .devdata/data | cut -f1) of data so far"
}

# "1-3,5" -> 1 2 3 5, one a line
expand_rows() {
    local part
    for part in ${1//,/ }; do
        if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then seq "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
        elif [[ $part =~ ^[0-9]+$ ]]; then echo "$part"
        else echo "device.sh: rows '$1' are not like 1-3,5" >&2; exit 2; fi
    done
}

run() {
    local table=$1 rows=$2 seconds=$3 again=() rc=0 out=${OUT:-.devdata}
    case "${4-}" in
        "") ;;
        --rerun) again=(--rerun) ;;  # rows the table records as done run again (their runs are not here)
        *) usage ;;
    esac
    export PYTHONPATH=$here/.devdata/site:$here/src PYTHONUNBUFFERED=1
    # Only the data sets that travelled are checked; a part that did not would fail here.
    (cd .devdata/data && grep -F "$(ls -d */ | sed 's|/$||;s|^|./|;s|$|/|')" SHA256SUMS | sha256sum -c --quiet) \
        || { echo "device.sh: the data on the device does not match SHA256SUMS: load every part first" >&2; exit 2; }
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    # One process per row, side by side: one small federation leaves most of a GPU idle. Each
    # writes its own run directory; the table is merged under its lock.
    local row list pid pids=() status=()
    rm -f .devdata/row*.log
    list=$(expand_rows "$rows")
    for row in $list; do
        timeout -s TERM "$seconds" python3 -m stocfl reproduce "$table" --rows "$row" --data-dir .devdata/data --quiet "${again[@]}" \
            > ".devdata/row$row.log" 2>&1 &
        pids+=("$!")
    done
    for pid in "${pids[@]}"; do
        rc=0; wait "$pid" || rc=$?
        status+=("$rc")
    done
    echo "reproduce exited ${status[*]} for rows $(echo $list) (124: stopped after $seconds s at its last checkpoint)"
    local log
    for log in .devdata/row*.log; do  # what each printed beside the table (errors), then the table's rows
        echo "== $(basename "$log"):"; grep -vE '^(#|- |\||Source: |Command: |table: |$)' "$log" | tail -n 5 || true
    done
    grep '^|' "reproductions/$table.md" || true
    [ -d "reproductions/runs/$table" ] || { echo "device.sh: no run directory was made: give it more than $seconds s" >&2; exit 1; }
    # One archive per run directory (a file that comes back holds at most 16 MiB). A finished run
    # leaves its checkpoint behind: its summary, metrics and authors' metric make its rows.
    local dir skip
    for dir in "reproductions/runs/$table"/*/; do
        skip=(--exclude=.lock)
        if [ -f "$dir/summary.json" ] && ls "$dir"/authors_metric*.json > /dev/null 2>&1; then
            skip+=(--exclude=checkpoint.safetensors)
        fi
        tar czf "$out/$(basename "$dir").tgz" "${skip[@]}" -C "reproductions/runs/$table" "$(basename "$dir")"
    done
    cp "reproductions/$table.md" "$out/"
    ls -l "$out"
}

unpack() {
    local from=$1 table=$2
    ls "$from"/*.tgz > /dev/null 2>&1 || { echo "device.sh: no run archives (*.tgz) in $from: give the call's files_at" >&2; exit 2; }
    mkdir -p "reproductions/runs/$table"
    for f in "$from"/*.tgz; do tar xzf "$f" -C "reproductions/runs/$table"; done
    PYTHONPATH=$here/src .venv/bin/python -m stocfl reproduce "$table" --data-dir "${STOCFL_DATA_DIR:-../shared/data}" --report --quiet
}

[ $# -ge 1 ] || usage
verb=$1; shift
case "$verb" in
    stage) [ $# -ge 2 ] || usage; stage "$@" ;;
    load) [ $# -eq 1 ] || usage; load "$1" ;;
    run) [ $# -eq 3 ] || [ $# -eq 4 ] || usage; run "$@" ;;
    unpack) [ $# -eq 2 ] || usage; unpack "$@" ;;
    *) usage ;;
esac
