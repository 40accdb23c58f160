#!/usr/bin/env bash
# scripts/sass_loops.py on a stand-in cuobjdump listing (no GPU, no CUDA): functions are found by
# a part of their name, loops by their backward branches (a forward branch is not one), a loop
# below --min is left out, --range counts an address range, and bad input is refused.
set -euo pipefail
src=${1:?usage: scripts_sass_loops.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tool="$src/scripts/sass_loops.py"
cat > "$work/k.sass" <<'SASS'
	code for sm_90a
		Function : _Z6kernelILi128EEvPf
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   IMAD.MOV.U32 R2, RZ, RZ, R0 ;          /* 0x000000ffff027224 */
        /*0030*/                   FFMA R3, R2, R2, R3 ;                  /* 0x0000000202037223 */
        /*0040*/              @!P0 BRA 0x60 ;                             /* 0x0000000000008947 */
        /*0050*/                   FADD R3, R3, 1 ;                       /* 0x3f80000003037421 */
        /*0060*/                   ISETP.GE.AND P0, PT, R2, 0x4, PT ;     /* 0x000000040200780c */
        /*0070*/              @!P0 BRA 0x20 ;                             /* 0x0000000000e08947 */
        /*0080*/                   EXIT ;                                 /* 0x000000000000794d */
		Function : _Z5otherv
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
SASS
out=$(python3 "$tool" "$work/k.sass" kernelILi128 --min 1)
echo "$out"
expected="_Z6kernelILi128EEvPf: 9 instructions
  loop 0x20-0x70: 6 instructions  BRA:2 IMAD:1 FFMA:1 FADD:1 ISETP:1"
[ "$out" = "$expected" ] || { echo "unexpected loops"; exit 1; }
# Below --min: the function line alone.
[ "$(python3 "$tool" "$work/k.sass" kernelILi128 --min 7)" = "_Z6kernelILi128EEvPf: 9 instructions" ] ||
  { echo "--min not applied"; exit 1; }
out=$(python3 "$tool" "$work/k.sass" kernel --range 30 50)
[ "$out" = "_Z6kernelILi128EEvPf: 9 instructions
  0x30-0x50: 3 instructions  FFMA:1 BRA:1 FADD:1" ] || { echo "unexpected range: $out"; exit 1; }
expect_refusal() {  # message, arguments...
  local msg=$1; shift
  if python3 "$tool" "$@" > /dev/null 2> "$work/err"; then echo "accepted: $*"; exit 1; fi
  grep -q "$msg" "$work/err" || { echo "no message '$msg' for $*:"; cat "$work/err"; exit 1; }
}
expect_refusal "no function" "$work/k.sass" nosuchkernel
expect_refusal "No such file" "$work/missing.sass" kernel
expect_refusal "hexadecimal" "$work/k.sass" kernel --range 0x zz
echo "scripts_sass_loops: ok"
