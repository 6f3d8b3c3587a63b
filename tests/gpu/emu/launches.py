#!/usr/bin/env python3
"""kernels/cuda/X.cu -> C++ for the CPU emulation (tests/gpu/emu/run.sh): each
launch `kernel<<<grid, block, smem, stream>>>(args)` becomes
`(emu_check_args("kernel", args), emu_launch(std::bind(kernel, args), grid,
block, smem, stream))` (the pointer arguments must be device memory; the
arguments are evaluated at the launch, as a GPU copies them), and the
dynamic shared memory `extern __shared__ float sm[];` a pointer to the
launch's buffer. Nothing else changes.
    launches.py IN.cu OUT.cpp"""
import sys

src, dst = sys.argv[1], sys.argv[2]
s = open(src).read()
s = s.replace('extern __shared__ float sm[];', 'float *sm = (float *)emu_dyn_smem;')
# the one launch inside a macro (elementwise.cu's conversions)
s = s.replace('name##_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(src, dst, n);',
              'emu_check_args(#name, src, dst), '
              'emu_launch(std::bind(name##_kernel, src, dst, n), grid_for(n, THREADS), THREADS, 0, cuda_ops_stream());')
out, i = [], 0
while True:
    j = s.find('<<<', i)
    if j < 0:
        out.append(s[i:])
        break
    k = j  # the kernel's name: an identifier, maybe with <template arguments>
    if s[k - 1] == '>':
        depth = 0
        while True:
            k -= 1
            if s[k] == '>':
                depth += 1
            elif s[k] == '<':
                depth -= 1
                if depth == 0:
                    break
    while k > 0 and (s[k - 1].isalnum() or s[k - 1] == '_'):
        k -= 1
    e = s.find('>>>', j)
    if s[e + 3] != '(':
        sys.exit('%s: a launch without its arguments: %r' % (src, s[j:e + 20]))
    depth, p = 0, e + 3
    while True:  # the matching parenthesis
        if s[p] == '(':
            depth += 1
        elif s[p] == ')':
            depth -= 1
            if depth == 0:
                break
        p += 1
    out.append(s[i:k])
    args = s[e + 4:p]
    check = 'emu_check_args("%s", %s), ' % (s[k:j].replace('"', ''), args) if args.strip() else ''
    # the arguments are evaluated now (a GPU copies them at the launch; a captured graph runs later)
    call = 'std::bind(%s, %s)' % (s[k:j], args) if args.strip() else '[=]() { %s(); }' % s[k:j]
    out.append('(%semu_launch(%s, %s))' % (check, call, s[j + 3:e]))
    i = p + 1
open(dst, 'w').write(''.join(out))
