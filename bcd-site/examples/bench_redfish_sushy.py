#!/usr/bin/env python3
"""The peer of `scripts/bench redfish`: sushy (the Redfish library OpenStack Ironic uses) reading the same
inventory a `bcd site redfish inspect` reads: systems with processors, memory, Ethernet interfaces, storage with
drives and simple storage, plus managers and chassis. Prints one JSON line: {"seconds": wall time, "systems": n,
"errors": [...]}. Requests are counted by the server. Usage: bench_redfish_sushy.py URL"""
import json
import sys
import time

import sushy
from sushy import auth as sushy_auth

url = sys.argv[1]
errors = []


def attempt(what, fn):
    try:
        return fn()
    except Exception as e:  # sushy raises its own errors for missing attributes and 404s
        errors.append(f"{what}: {type(e).__name__}")
        return None


t0 = time.monotonic()
root = sushy.Sushy(url + "/redfish/v1", auth=sushy_auth.BasicAuth("admin", "secret"))
systems = attempt("systems", lambda: root.get_system_collection().get_members()) or []
for s in systems:
    procs = attempt("processors", lambda: s.processors.get_members())
    attempt("processor summary", lambda: s.processors.summary)
    attempt("memory", lambda: s.memory.get_members() if hasattr(s, "memory") and s.memory else None)
    attempt("ethernet", lambda: s.ethernet_interfaces.get_members())
    storages = attempt("storage", lambda: s.storage.get_members()) or []
    for st in storages:
        attempt("drives", lambda: st.drives)
    attempt("simple storage", lambda: s.simple_storage.get_members())
attempt("managers", lambda: root.get_manager_collection().get_members())
attempt("chassis", lambda: root.get_chassis_collection().get_members())
print(json.dumps({"seconds": time.monotonic() - t0, "systems": len(systems), "errors": errors[:5]}))
