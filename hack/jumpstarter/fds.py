#!/usr/bin/env python3
"""Extracts the Jumpstarter wire schema from the published `jumpstarter-protocol` package.

The package ships generated `*_pb2.py` modules whose serialized FileDescriptorProtos are the
protocol's source of truth. Importing them registers every file (and its imports, such as
google/api/annotations.proto) in protobuf's default pool; this script writes those files, in
dependency order, as one FileDescriptorSet.

    python3 hack/jumpstarter/fds.py OUT.fds      # write
    python3 hack/jumpstarter/fds.py --check FILE # exit 1 if FILE differs from the package

Run it in a virtualenv holding `jumpstarter-protocol==0.9.0` (hack/jumpstarter/venv.sh makes one).
"""
import importlib
import pkgutil
import sys

from google.protobuf import descriptor_pb2, descriptor_pool

import jumpstarter_protocol


def roots():
    names = []
    for mod in pkgutil.walk_packages(jumpstarter_protocol.__path__, jumpstarter_protocol.__name__ + "."):
        if mod.name.endswith("_pb2"):
            module = importlib.import_module(mod.name)
            names.append(module.DESCRIPTOR.name)
    return sorted(names)


def file_set():
    pool = descriptor_pool.Default()
    out = descriptor_pb2.FileDescriptorSet()
    seen = set()

    def add(name):
        if name in seen:
            return
        seen.add(name)
        fd = pool.FindFileByName(name)
        for dep in fd.dependencies:
            add(dep.name)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        out.file.append(proto)

    for name in roots():
        add(name)
    return out.SerializeToString(deterministic=True)


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        with open(argv[2], "rb") as f:
            committed = f.read()
        if committed != file_set():
            print(f"{argv[2]} differs from jumpstarter-protocol's embedded descriptors", file=sys.stderr)
            return 1
        print("descriptor set matches jumpstarter-protocol", file=sys.stderr)
        return 0
    if len(argv) == 2:
        with open(argv[1], "wb") as f:
            f.write(file_set())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
