#!/usr/bin/env bash
# Run a command from a cold page cache and report how many bytes the block layer read for it
# (/proc/vmstat pgpgin: page-cache misses, mmap faults and O_DIRECT reads alike), so that
# engines that stream through mmap (llama.cpp) and through their own reads (sluice) are counted
# the same way. Run two lengths (e.g. tg8 and tg72) and divide the difference by the extra tokens
# to get the bytes read per token without the load. Dropping the page cache needs root.
#
# usage: bench/disk_reads.sh [--keep-cache] -- CMD ARGS...
#   prints on stderr: disk_reads: <bytes> bytes read (<GB> GB) in <s> s: CMD
set -euo pipefail
drop=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --keep-cache) drop=0; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "disk_reads.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $# -gt 0 ]] || { echo "disk_reads.sh: no command given (see --help)" >&2; exit 2; }
if [[ $drop == 1 ]]; then
    sync
    echo 3 > /proc/sys/vm/drop_caches 2>/dev/null \
        || { echo "disk_reads.sh: cannot drop the page cache (needs root); use --keep-cache" >&2; exit 1; }
fi
before=$(awk '/^pgpgin /{print $2}' /proc/vmstat)
start=$(date +%s.%N)
status=0
"$@" || status=$?
after=$(awk '/^pgpgin /{print $2}' /proc/vmstat)
secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
bytes=$(( (after - before) * 1024 ))
echo "disk_reads: $bytes bytes read ($(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1e9 }') GB) in ${secs} s: $*" >&2
exit $status
