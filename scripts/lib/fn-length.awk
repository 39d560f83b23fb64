# Prints FILE:LINE NAME LENGTH for every fn longer than MAX lines (rustfmt'd code: a fn ends at the first line that
# is its own indentation followed by "}").
FNR == 1 { open = 0 }
{
  if (open && $0 == indent "}") {
    len = FNR - start + 1
    if (len > max) printf "%s:%d %s %d lines\n", FILENAME, start, name, len
    open = 0
  }
  if (!open && match($0, /^ *(pub(\([a-z]+\))? )?(const )?(async )?(unsafe )?fn [A-Za-z0-9_]+/)) {
    line = $0
    if (line ~ /;$/) next
    indent = line; sub(/[^ ].*$/, "", indent)
    name = substr($0, RSTART, RLENGTH); sub(/.*fn /, "", name)
    start = FNR; open = 1
    if (line ~ /\}$/ && line ~ /\{/) open = 0
  }
}
