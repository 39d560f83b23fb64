#!/usr/bin/env python3
"""Builds a mockup tree from single captured documents (test fixtures that are one JSON file per resource): each file
is copied byte for byte to <DEST>/<its @odata.id below /redfish/v1>/index.json. Usage: assemble.py DEST FILE..."""
import json
import os
import shutil
import sys

dest, files = sys.argv[1], sys.argv[2:]
for f in files:
    with open(f, "rb") as fh:
        doc = json.loads(fh.read())
    oid = doc["@odata.id"].rstrip("/")
    assert oid.startswith("/redfish/v1"), f
    rel = oid[len("/redfish/v1"):].lstrip("/")
    os.makedirs(os.path.join(dest, rel), exist_ok=True)
    out = os.path.join(dest, rel, "index.json")
    assert not os.path.exists(out), f"{f}: {oid} given twice"
    shutil.copyfile(f, out)
    print(f"{f} -> {rel or '.'}/index.json")
