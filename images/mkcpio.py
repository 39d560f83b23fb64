#!/usr/bin/env python3
"""Write a newc cpio archive of a directory tree to stdout, plus /dev/console (c 5 1), without needing root or
mknod. Entries are sorted, owned by root, mtime 0: the same tree always gives the same bytes.
Usage: mkcpio.py DIR > archive.cpio"""
import os
import stat
import sys


def header(out, ino, mode, nlink, size, rdevmajor, rdevminor, name):
    name_b = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, rdevmajor, rdevminor, len(name_b), 0]
    out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + name_b)
    out.write(b"\0" * ((4 - (110 + len(name_b)) % 4) % 4))


def pad(out, n):
    out.write(b"\0" * ((4 - n % 4) % 4))


def main():
    root = sys.argv[1]
    out = sys.stdout.buffer
    ino = 1
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            entries.append(rel)
        for f in sorted(filenames):
            entries.append(os.path.normpath(os.path.join(rel, f)))
    have_dev = "dev" in entries
    if not have_dev:
        header(out, ino, stat.S_IFDIR | 0o755, 2, 0, 0, 0, "dev")
        ino += 1
    for rel in entries:
        path = os.path.join(root, rel)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            header(out, ino, stat.S_IFDIR | (st.st_mode & 0o7777), 2, 0, 0, 0, rel)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(path).encode()
            header(out, ino, stat.S_IFLNK | 0o777, 1, len(target), 0, 0, rel)
            out.write(target)
            pad(out, len(target))
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                data = f.read()
            header(out, ino, stat.S_IFREG | (st.st_mode & 0o7777), 1, len(data), 0, 0, rel)
            out.write(data)
            pad(out, len(data))
        ino += 1
    header(out, ino, stat.S_IFCHR | 0o600, 1, 0, 5, 1, "dev/console")
    header(out, 0, 0, 1, 0, 0, 0, "TRAILER!!!")


if __name__ == "__main__":
    main()
