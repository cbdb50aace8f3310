"""A phase of bench/device.py for its tests: one item crashes its child, one overruns."""

import os
import time

import models  # noqa: F401  (the package, not bench/models.py: see bench/device.py's sys.path)

TITLE = "A test phase"
WEIGHT = 1.0


def items(dry_run):
    return [{"name": n} for n in ("first", "crash", "slow", "after")]


def run_item(item, ctx):
    if item["name"] == "crash":
        os._exit(9)  # as a segfault or the OOM killer would end it
    if item["name"] == "slow":
        time.sleep(max(ctx.left(), 0) + 60)  # still under way when the share and its grace end
    return {"status": "ok", "left": ctx.left()}


def markdown(rows, info):
    return "\n".join(f"- {r['name']}: {r['status']}" for r in rows)
