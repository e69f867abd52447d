/* One thread's AMX blocks as native/product.c's amx_panels runs them for many rows (fifty-third session): a panel of
 * 24 columns (tiles of 16 and 8 columns) against slices of 16 input rows, as shipped, with the shipped prefetches, and
 * with each panel repacked as two contiguous tiles a block. Usage:
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f amx_tile_loads.c -o /tmp/h && /tmp/h K_PAIRS ROWS PANELS REPEATS
 * (SmolLM2's gate/up: 288 256 128 5; down: 768 256 24 5). On the AMX Xeon: ~550-630 GFLOP/s a thread whichever way,
 * the prefetches 3-10% slower with the panel already in cache; a TDPBF16PS alone ~7 ns, a block of three tile loads
 * and two products 27-47 ns: the loads, not the products, bound it. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#define PANEL 24
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TC;
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static void cfg(void){ TC c; memset(&c,0,sizeof c); c.palette=1;
  for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;} c.colsb[1]=32; c.colsb[4]=32; c.colsb[6]=32; _tile_loadconfig(&c);}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int64_t k2=atoi(argv[1]), m=atoi(argv[2]), panels=atoi(argv[3]); int reps=atoi(argv[4]);
  uint32_t *W=aligned_alloc(64,4*k2*PANEL*panels), *X=aligned_alloc(64,4*k2*m);
  uint32_t *R=aligned_alloc(64,4*k2*PANEL); /* a repacked panel: per block, tile A (16x16 words) then tile B (16x8) */
  for(int64_t i=0;i<k2*PANEL*panels;i++) W[i]=0x3f803f80u; for(int64_t i=0;i<k2*m;i++) X[i]=0x3f803f80u;
  float sums[32*PANEL];
  cfg();
  for (int variant=0; variant<3; variant++) {
    double best=1e9;
    for(int rep=0;rep<reps;rep++){
      double t=now();
      for(int64_t p=0;p<panels;p++){
        const uint32_t *w=W+p*k2*PANEL;
        if(variant==2){ /* repack: block b rows r: A[b][r][0..15], B[b][r][0..7] */
          for(int64_t b=0;b<k2;b+=16) for(int r=0;r<16;r++){
            memcpy(R+b*PANEL+r*16, w+(b+r)*PANEL, 64); memcpy(R+b*PANEL+256+r*8, w+(b+r)*PANEL+16, 32);} }
        for(int64_t j0=0;j0<m;j0+=16){
          _tile_zero(0);_tile_zero(1);
          const uint32_t *x=X+j0*k2;
          for(int64_t i=0;i<k2;i+=16){
            if(variant==1) for(int l=0;l<24;l++) _mm_prefetch((const char*)(w+(i+64)*PANEL)+64*l,_MM_HINT_T0);
            _tile_loadd(2,x+i,k2*4);
            if(variant==2){ _tile_loadd(3,R+i*PANEL,64); _tile_loadd(4,R+i*PANEL+256,32);} 
            else { _tile_loadd(3,w+i*PANEL,PANEL*4); _tile_loadd(4,w+i*PANEL+16,PANEL*4);} 
            _tile_dpbf16ps(0,2,3); _tile_dpbf16ps(1,2,4);
          }
          _tile_stored(0,sums,PANEL*4); _tile_stored(1,sums+16,PANEL*4);
        }
      }
      double e=now()-t; if(e<best)best=e;
    }
    double flop=2.0*m*k2*2*PANEL*panels;
    printf("variant %d (%s): %.3f ms, %.0f GFLOP/s one thread\n", variant, variant==0?"as shipped, no prefetch":variant==1?"with prefetch":"repacked tiles", best*1e3, flop/best/1e9);
  }
  _tile_release(); printf("%f\n", sums[0]);
}
