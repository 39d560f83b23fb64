# Shared by images/build-*: the Debian kernel (cached) and the static bcd-ramdisk binary.
# Sourced with the repository root as the working directory.
OUT=${BC_IMAGES_OUT:-$PWD/images/out}
mkdir -p "$OUT"
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
MUSL=x86_64-unknown-linux-musl

# Sets KVER (e.g. 6.1.0-57-amd64) and KDIR (the unpacked package) from the linux-image-amd64 candidate.
fetch_kernel() {
  local meta ver pkg
  meta=$(apt-cache policy linux-image-amd64 | awk '/Candidate:/ {print $2}')
  [ -n "$meta" ] && [ "$meta" != "(none)" ] || { echo "images: no linux-image-amd64 candidate (apt-get update?)" >&2; exit 1; }
  pkg=$(apt-cache show "linux-image-amd64=$meta" | awk -F'[ ,()]+' '/^Depends:/ {print $2; exit}')
  KVER=${pkg#linux-image-}
  KDIR=$OUT/kernel-$KVER
  if [ ! -f "$KDIR/boot/vmlinuz-$KVER" ]; then
    local dl; dl=$(mktemp -d "$OUT/dl.XXXXXX")
    (cd "$dl" && apt-get download -q "$pkg" >/dev/null 2>&1) || { rm -rf "$dl"; echo "images: apt-get download $pkg failed" >&2; exit 1; }
    rm -rf "$KDIR.tmp"; dpkg -x "$dl"/*.deb "$KDIR.tmp"; rm -rf "$dl"
    mv "$KDIR.tmp" "$KDIR"
  fi
  echo "kernel: $pkg ($KVER)"
}

# Sets BIN to the static bcd-ramdisk (BC_RAMDISK_BIN overrides; else a musl build with the `ramdisk` profile:
# release with fat LTO, which keeps the binary under 8 MiB now that it links bcd's join and session). Builds the
# lab OS's static bcd beside it.
build_binary() {
  if [ -n "${BC_RAMDISK_BIN:-}" ]; then BIN=$BC_RAMDISK_BIN; return; fi
  # The lab OS's bcd (images/build-lab-os) in the same invocation: built alone, its dependencies resolve to other
  # features (bcd-ramdisk's own dependencies turn on more of tokio and the like) and the whole tree was compiled a
  # second time, and the two fat-LTO links now run side by side.
  cargo build -q --locked --profile ramdisk --target $MUSL -p bcd-ramdisk --bin bcd-ramdisk -p bcd --bin bcd \
    --no-default-features
  # Debug symbols stay in the build tree; the initramfs carries the stripped copy.
  BIN=$OUT/bcd-ramdisk
  strip --strip-all -o "$BIN.tmp" "$TARGET_DIR/$MUSL/ramdisk/bcd-ramdisk" && mv "$BIN.tmp" "$BIN"
}

# stage_modules ROOT WANTED: copy the wanted modules and their dependencies from the kernel package into ROOT and
# write ROOT/lib/modules/load-order (absolute path, dependencies, device aliases; dependencies first), resolved by
# `bcd-ramdisk modules-order`. At boot only the drivers of present devices (and what they need) are loaded.
stage_modules() {
  local root=$1 wanted=$2 moddir=$KDIR/lib/modules/$KVER rel
  mkdir -p "$root/lib/modules/$KVER"
  cp "$moddir/modules.builtin" "$root/lib/modules/$KVER/"
  "$BIN" modules-order --dir "$moddir" --want "$wanted" > "$root/lib/modules/order.txt"
  "$BIN" modules-order --dir "$moddir" --want "$wanted" --load-list "/lib/modules/$KVER" 2>/dev/null \
    > "$root/lib/modules/load-order"
  while read -r rel; do
    mkdir -p "$root/lib/modules/$KVER/$(dirname "$rel")"
    cp "$moddir/$rel" "$root/lib/modules/$KVER/$rel"
  done < "$root/lib/modules/order.txt"
  rm "$root/lib/modules/order.txt"
}

size_of() { stat -c %s "$1"; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
