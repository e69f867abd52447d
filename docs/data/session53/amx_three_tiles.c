/* Two panels (48 columns) repacked as three full 16-column tiles a block, against the shipped 16 + 8 (fifty-third
 * session): fewer tile loads per multiply-add, but the repacking costs. Usage as amx_tile_loads.c. On the AMX Xeon,
 * 256 rows: gate/up's shape 0.87x as fast, down's 1.63x; 32-64 rows 0.75-0.78x. Not pursued: mixed, and a second
 * layout of the weights would break "one copy of each weight in memory". */
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
static void cfg(int v){ TC c; memset(&c,0,sizeof c); c.palette=1;
  for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;} if(!v){c.colsb[1]=32; c.colsb[4]=32;} _tile_loadconfig(&c);}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int64_t k2=atoi(argv[1]), m=atoi(argv[2]), panels=atoi(argv[3]); int reps=atoi(argv[4]);
  uint32_t *W=aligned_alloc(64,4*k2*PANEL*panels), *X=aligned_alloc(64,4*k2*m);
  uint32_t *R=aligned_alloc(64,4*k2*48); /* two panels as 3 tiles of 16 columns a block */
  for(int64_t i=0;i<k2*PANEL*panels;i++) W[i]=0x3f803f80u; for(int64_t i=0;i<k2*m;i++) X[i]=0x3f803f80u;
  float sums[16*48];
  for (int variant=0; variant<2; variant++) { cfg(variant);
    double best=1e9;
    for(int rep=0;rep<reps;rep++){
      double t=now();
      if (variant==0) {
      for(int64_t p=0;p<panels;p++){
        const uint32_t *w=W+p*k2*PANEL;
        for(int64_t j0=0;j0<m;j0+=16){
          _tile_zero(0);_tile_zero(1);
          const uint32_t *x=X+j0*k2;
          for(int64_t i=0;i<k2;i+=16){
            _tile_loadd(2,x+i,k2*4);
            _tile_loadd(3,w+i*PANEL,PANEL*4); _tile_loadd(4,w+i*PANEL+16,PANEL*4);
            _tile_dpbf16ps(0,2,3); _tile_dpbf16ps(1,2,4);
          }
          _tile_stored(0,sums,PANEL*4); _tile_stored(1,sums+16,PANEL*4);
        }
      }
      } else {
      for(int64_t p=0;p<panels;p+=2){
        const uint32_t *a=W+p*k2*PANEL, *b=a+k2*PANEL;
        for(int64_t u=0;u<k2;u++){ /* unit u: 48 columns -> R[(u/16)*768 + t*256 + (u%16)*16] */
          uint32_t *r=R+(u/16)*768+(u%16)*16;
          memcpy(r, a+u*PANEL, 64); memcpy(r+256, a+u*PANEL+16, 32); memcpy(r+256+8, b+u*PANEL, 32); memcpy(r+512, b+u*PANEL+8, 64);
        }
        for(int64_t j0=0;j0<m;j0+=16){
          _tile_zero(0);_tile_zero(1);_tile_zero(5);
          const uint32_t *x=X+j0*k2;
          for(int64_t i=0;i<k2;i+=16){
            const uint32_t *r=R+(i/16)*768;
            _tile_loadd(2,x+i,k2*4);
            _tile_loadd(3,r,64); _tile_loadd(6,r+256,64); _tile_loadd(7,r+512,64);
            _tile_dpbf16ps(0,2,3); _tile_dpbf16ps(1,2,6); _tile_dpbf16ps(5,2,7);
          }
          _tile_stored(0,sums,48*4); _tile_stored(1,sums+16,48*4); _tile_stored(5,sums+32,48*4);
        }
      }
      }
      double e=now()-t; if(e<best)best=e;
    }
    double flop=2.0*m*k2*2*PANEL*panels;
    printf("variant %d (%s): %.3f ms, %.0f GFLOP/s one thread\n", variant, variant==0?"as shipped":"two panels as three full tiles", best*1e3, flop/best/1e9);
  }
  _tile_release(); printf("%f\n", sums[0]);
}
