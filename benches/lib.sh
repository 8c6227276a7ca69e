# Shell helpers the benches' scripts share (sourced, not run).

# le64 N: N as 8 little-endian bytes.
le64() {
  local i
  for i in 0 1 2 3 4 5 6 7; do
    # shellcheck disable=SC2059
    printf "\\$(printf %03o $(( ($1 >> (8 * i)) & 255 )))"
  done
}

# safetensors FILE DTYPE WIDTH NAME:MIB...: a .safetensors file of random values, each tensor
# [MIB MiB / (1024 * WIDTH), 1024] of DTYPE (WIDTH bytes a value).
safetensors() {
  local file=$1 dtype=$2 width=$3 header="" offset=0 spec name bytes
  shift 3
  for spec in "$@"; do
    name=${spec%%:*}
    bytes=$(( ${spec##*:} << 20 ))
    header+="${header:+,}\"$name\":{\"dtype\":\"$dtype\",\"shape\":[$(( bytes / 1024 / width )),1024],\"data_offsets\":[$offset,$(( offset + bytes ))]}"
    offset=$(( offset + bytes ))
  done
  header="{$header}"
  while (( ${#header} % 8 )); do header+=" "; done
  { le64 ${#header}; printf '%s' "$header"; head -c "$offset" /dev/urandom; } >"$file"
}
