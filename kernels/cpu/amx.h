/* What every AMX kernel needs before its first tile instruction (linear_gguf_amx.c,
 * gemm_bf16.c and prefill_attention_amx.c): the kernel's grant of the tile state, and one
 * tile configuration; and the 16 x 16 dword transpose that lays data out as tiles (or
 * back) in registers. Include only where __AMX_TILE__ is defined.
 */
#ifndef TLE_AMX_H
#define TLE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the 8 KB tile state only to processes that ask (arch_prctl); asking
 * again after a grant is harmless, but the answer is cached so a call costs nothing.
 * 0 granted, 1 refused. */
static int amx_permission(void) {
    static int state = -1;  /* -1 unknown */
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) < 0) {
        long rc = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                          18 /* XFEATURE_XTILEDATA */);
        __atomic_store_n(&state, rc == 0 ? 0 : 1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&state, __ATOMIC_ACQUIRE);
}

struct amx_tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-7, each 16 rows of 64 bytes (a float32 16 x 16 accumulator, or 16 rows of 16
 * bf16 pairs), for the calling thread until _tile_release. */
static inline void amx_configure_full_tiles(void) {
    struct amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* 16 vectors of 16 dwords, transposed in registers (r[i][j] -> r[j][i]). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int g = 0; g < 4; g++) {
        t[4 * g] = _mm512_unpacklo_epi32(r[4 * g], r[4 * g + 1]);
        t[4 * g + 1] = _mm512_unpackhi_epi32(r[4 * g], r[4 * g + 1]);
        t[4 * g + 2] = _mm512_unpacklo_epi32(r[4 * g + 2], r[4 * g + 3]);
        t[4 * g + 3] = _mm512_unpackhi_epi32(r[4 * g + 2], r[4 * g + 3]);
    }
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* u[4g + j] holds, per 128-bit lane l, column j + 4l of rows 4g..4g+3. */
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[j + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[j + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

#endif
