// Does compute-sanitizer's racecheck follow happens-before through named barriers?
//
// The D=256 backward (both modes since session 12) hands one SMEM dQ chunk from warpgroup 0 to
// warpgroup 1 through the dQ writer warp (flexattn_sm90.bwd_kernel.write_dq_block):
//
//   warps 0-3 (warpgroup 0): write buf, bar.arrive FULL0   --.
//   warp 8 (dQ writer):       bar.sync FULL0, bar.arrive EMPTY1  --.
//   warps 4-7 (warpgroup 1):                              bar.sync EMPTY1, write buf
//
// bar.arrive orders the arriving thread's prior memory accesses before the barrier's completion
// for every participant (PTX ISA, bar / barrier), so the two writes are ordered. Mode 0 is that
// chain; mode 1 drops the barriers (a real race), as a control; mode 2 has warpgroup 0 arrive on
// EMPTY1 itself as well (288 threads), so its writes reach warpgroup 1 through one barrier.
// racecheck reports a hazard in all three (H200, session 13): it does not take bar.arrive as
// ordering the arriving warps' writes, chain or not. Build and run:
//
//   nvcc -arch=sm_90a -o barrier_chain barrier_chain.cu
//   for m in 0 1 2; do compute-sanitizer --tool racecheck ./barrier_chain $m; done
#include <cstdio>
#include <cstdlib>

__global__ void chain(int mode, float* out) {
  __shared__ float buf[128];
  int t = threadIdx.x, warp = t / 32;
  if (warp < 4) {
    buf[t] = t;
    if (mode != 1) asm volatile("bar.arrive 1, 160;" ::: "memory");
    if (mode == 2) asm volatile("bar.arrive 2, 288;" ::: "memory");
  } else if (warp < 8) {
    if (mode == 0) asm volatile("bar.sync 2, 160;" ::: "memory");
    if (mode == 2) asm volatile("bar.sync 2, 288;" ::: "memory");
    buf[t - 128] = t;
  } else if (mode != 1) {
    asm volatile("bar.sync 1, 160;" ::: "memory");
    if (mode == 0) asm volatile("bar.arrive 2, 160;" ::: "memory");
    if (mode == 2) asm volatile("bar.arrive 2, 288;" ::: "memory");
  }
  __syncthreads();
  if (t < 128) out[t] = buf[t];
}

int main(int argc, char** argv) {
  if (argc != 2 || argv[1][0] < '0' || argv[1][0] > '2') {
    fprintf(stderr, "usage: %s 0|1|2   (0: chain, 1: no barriers, 2: one barrier)\n", argv[0]);
    return 2;
  }
  int mode = argv[1][0] - '0';
  float* out;
  cudaMalloc(&out, 128 * sizeof(float));
  chain<<<1, 288>>>(mode, out);
  cudaError_t err = cudaDeviceSynchronize();
  printf("mode %d: %s\n", mode, cudaGetErrorString(err));
  cudaFree(out);
  return err == cudaSuccess ? 0 : 1;
}
