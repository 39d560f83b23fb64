#!/bin/sh
# Install the Better Compute node daemon on a GPU server and join it to the control plane.
#
#   BCD_JOIN_TOKEN=bcjt_… sh install.sh --gateway-url https://gw.example.com:7443 \
#       --ca-pin sha256:<hex> --join-public-key <base64url> --binary ./bcd
#
# Installs /usr/local/bin/bcd, /etc/bcd/bcd.toml (the pinned configuration), the systemd unit bcd.service, then runs
# `bcd join`. With DESTDIR=/some/root everything goes under that staging root instead, nothing is enabled or
# started, and the join stores its state under $DESTDIR/var/lib/bcd (how the tests run it).
# The token is read from BCD_JOIN_TOKEN or --token-file (never put it on a command line other users can see).
set -eu

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
die() { echo "install.sh: $*" >&2; exit 1; }

gateway_url= ca_pin= join_key= binary= binary_url= binary_sha256= token_file= gpu_backend= hardware_root= cdi_dir=
join=yes start=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --gateway-url) gateway_url=$2; shift 2 ;;
    --ca-pin) ca_pin=$2; shift 2 ;;
    --join-public-key) join_key=$2; shift 2 ;;
    --binary) binary=$2; shift 2 ;;
    --binary-url) binary_url=$2; shift 2 ;;
    --binary-sha256) binary_sha256=$2; shift 2 ;;
    --token-file) token_file=$2; shift 2 ;;
    --gpu-backend) gpu_backend=$2; shift 2 ;;
    --hardware-root) hardware_root=$2; shift 2 ;;
    --cdi-dir) cdi_dir=$2; shift 2 ;;
    --no-join) join=no; shift ;;
    --no-start) start=no; shift ;;
    -h|--help) usage ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
DESTDIR=${DESTDIR:-}
[ -n "$gateway_url" ] || die "--gateway-url is required"
case "$ca_pin" in sha256:????????????????????????????????????????????????????????????????) ;; *) die "--ca-pin must be sha256:<64 hex>" ;; esac
[ -n "$join_key" ] || die "--join-public-key is required"
# Where bcd writes the CDI spec of the node's bookings: the unit's sandbox must leave it writable (ReadWritePaths).
cdi_path=${cdi_dir:-/etc/cdi}
case "$cdi_path" in
  /*) ;;
  *) die "--cdi-dir must be an absolute path (the systemd unit makes it writable by path)" ;;
esac
case "$cdi_path" in
  *[[:space:]]*) die "--cdi-dir must not contain whitespace (systemd's ReadWritePaths= splits on it)" ;;
esac

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT INT TERM
if [ -n "$binary" ]; then
  [ -x "$binary" ] || die "--binary $binary is not an executable file"
  cp "$binary" "$stage/bcd"
elif [ -n "$binary_url" ]; then
  [ -n "$binary_sha256" ] || die "--binary-url needs --binary-sha256"
  command -v curl >/dev/null || die "curl is needed to download bcd"
  curl -fsSL --proto '=https' -o "$stage/bcd" "$binary_url" || die "downloading $binary_url failed"
  echo "$binary_sha256  $stage/bcd" | sha256sum -c --status || die "bcd download does not match --binary-sha256"
else
  die "give --binary PATH or --binary-url URL --binary-sha256 HEX"
fi

install -d -m 0755 "$DESTDIR/usr/local/bin" "$DESTDIR/etc/bcd" "$DESTDIR/etc/systemd/system"
install -d -m 0700 "$DESTDIR/var/lib/bcd"
# ReadWritePaths= needs the directory to exist, or systemd refuses to start the unit (226/NAMESPACE).
install -d -m 0755 "$DESTDIR$cdi_path"
install -m 0755 "$stage/bcd" "$DESTDIR/usr/local/bin/bcd"

{
  echo "# Written by install.sh: the control plane this node trusts. Flags to bcd override."
  echo "gateway_url = \"$gateway_url\""
  echo "ca_pin = \"$ca_pin\""
  echo "join_public_key = \"$join_key\""
  echo "state_dir = \"/var/lib/bcd\""
  [ -z "$gpu_backend" ] || echo "gpu_backend = \"$gpu_backend\""
  [ -z "$hardware_root" ] || echo "hardware_root = \"$hardware_root\""
  [ -z "$cdi_dir" ] || echo "cdi_dir = \"$cdi_dir\""
} > "$stage/bcd.toml"
install -m 0644 "$stage/bcd.toml" "$DESTDIR/etc/bcd/bcd.toml"

# The unit comes from the binary being installed (`bcd unit`: packaging/systemd/bcd.service), so the two match.
"$stage/bcd" unit --cdi-dir "$cdi_path" > "$stage/bcd.service" || die "bcd unit failed (is $binary a bcd of this version?)"
install -m 0644 "$stage/bcd.service" "$DESTDIR/etc/systemd/system/bcd.service"
echo "installed bcd, /etc/bcd/bcd.toml and bcd.service${DESTDIR:+ under $DESTDIR}"

if [ "$join" = yes ]; then
  if [ -z "$token_file" ]; then
    [ -n "${BCD_JOIN_TOKEN:-}" ] || die "set BCD_JOIN_TOKEN or give --token-file (or --no-join)"
    token_file=$stage/token
    (umask 077; printf '%s' "$BCD_JOIN_TOKEN" > "$token_file")
  fi
  env -u BCD_JOIN_TOKEN "$DESTDIR/usr/local/bin/bcd" --config "$DESTDIR/etc/bcd/bcd.toml" \
    --state-dir "$DESTDIR/var/lib/bcd" join --token-file "$token_file"
fi

if [ -z "$DESTDIR" ] && [ "$start" = yes ] && command -v systemctl >/dev/null 2>&1; then
  systemctl daemon-reload
  systemctl enable --now bcd.service
fi
