#!/usr/bin/env bash
# Run a training job until it finishes: resume it after a preemption, retry a crash a few times,
# stop at an error a restart will not fix. The exit codes are those of docs/elastic.md
# ("Exit codes for a requeue wrapper").
#
#   examples/requeue.sh trainguard run --nproc-per-node 8 --run-dir runs/a train.py
#
# Under Slurm, replace the "resume" line by `scontrol requeue "$SLURM_JOB_ID"; exit 0` (the job
# goes back to the queue and resumes from its preemption checkpoint when it starts again).
crashes=0
while true; do
    "$@"
    rc=$?
    case $rc in
        0) echo "requeue: finished"; exit 0 ;;
        129|130|131|143) echo "requeue: stopped by a signal after its save (exit $rc): resume" ;;
        78) echo "requeue: an error a restart will not fix (exit 78): fix it (see the log), then start again"; exit 78 ;;
        *)
            crashes=$((crashes + 1))
            if [ "$crashes" -ge "${REQUEUE_MAX_CRASHES:-3}" ]; then
                echo "requeue: failed $crashes times (last exit $rc): giving up"
                exit "$rc"
            fi
            echo "requeue: failed (exit $rc): start again" ;;
    esac
done
