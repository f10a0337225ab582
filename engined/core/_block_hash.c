/* vLLM 0.33's default block hash, `sha256(pickle.dumps((parent, tokens, None), 5))`, in C.
 *
 * Why: vLLM hashes every block it caches, and its default hash serialises a small tuple with
 * pickle and feeds it to hashlib; from Python that costs about 1.4 us a block, a tenth of the
 * compiled daemon's work per token (README, History 2026-12-06). Here the pickle bytes are
 * written straight from the block's token ids and hashed in place with the CPU's SHA
 * instructions (a portable SHA-256, FIPS 180-4, where it has none): about 0.2 us.
 *
 * The bytes must be exactly what CPython's pickler writes, or every hash differs from
 * vLLM's: protocol 5, one FRAME, SHORT_BINBYTES + MEMOIZE for the parent, MARK, each token as
 * BININT1 / BININT2 / BININT / LONG1 by size, TUPLE + MEMOIZE, NONE, TUPLE3 + MEMOIZE, STOP.
 * That holds for 4 <= block_size <= MAX_BLOCK_SIZE (a shorter tuple gets TUPLE1-3; a longer
 * one could outgrow pickle's 64 KiB frame) and parents shorter than 256 bytes; the caller
 * keeps the pure path for anything else. tests/core/test_block_hash.py holds it to pickle
 * and hashlib.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SHA_NI_PATH 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define MAX_BLOCK_SIZE 1024
/* PROTO + FRAME header, parent (opcode, length, <= 255 bytes, MEMOIZE), MARK, at most 7
 * bytes a token, the tail, and room for SHA-256 padding. */
#define PICKLE_MAX (2 + 9 + 2 + 255 + 1 + 1 + 7 * MAX_BLOCK_SIZE + 6)

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *blocks, size_t count);

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress_portable(uint32_t state[8], const uint8_t *blocks, size_t count) {
    uint32_t w[64];
    for (; count; count--, blocks += 64) {
        for (int t = 0; t < 16; t++) {
            const uint8_t *b = blocks + 4 * t;
            w[t] = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
        }
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                          K[t] + w[t];
            uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#ifdef HAVE_SHA_NI_PATH
/* The SHA extensions keep the state as two vectors, ABEF and CDGH; each
 * `_mm_sha256rnds2_epu32` runs two rounds, and `sha256msg1`/`sha256msg2` extend the message
 * schedule four words at a time. */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_sha_ni(uint32_t state[8],
                                                                        const uint8_t *blocks,
                                                                        size_t count) {
    const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&state[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&state[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; count; count--, blocks += 64) {
        __m128i abef_start = abef, cdgh_start = cdgh;
        __m128i w[4];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m128i next;
            if (i < 4) {
                next = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blocks + 16 * i)),
                                        byteswap);
            } else {
                /* w[i % 4] holds words 4(i-4).., the oldest; w[(i+3) % 4] the newest. */
                __m128i x0 = w[i % 4], x1 = w[(i + 1) % 4], x2 = w[(i + 2) % 4];
                __m128i x3 = w[(i + 3) % 4];
                next = _mm_sha256msg1_epu32(x0, x1);
                next = _mm_add_epi32(next, _mm_alignr_epi8(x3, x2, 4));
                next = _mm_sha256msg2_epu32(next, x3);
            }
            w[i % 4] = next;
            __m128i wk = _mm_add_epi32(next, _mm_loadu_si128((const __m128i *)&K[4 * i]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef_start);
        cdgh = _mm_add_epi32(cdgh, cdgh_start);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    dcba = _mm_blend_epi16(feba, dchg, 0xF0);
    hgfe = _mm_alignr_epi8(dchg, feba, 8);
    _mm_storeu_si128((__m128i *)&state[0], dcba);
    _mm_storeu_si128((__m128i *)&state[4], hgfe);
}

static int cpu_has_sha_ni(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    int sse = (ecx & bit_SSSE3) && (ecx & bit_SSE4_1);
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return 0;
    return sse && (ebx & (1u << 29));
}
#endif

static compress_fn best_compress = compress_portable;

/* SHA-256 of `msg[0:len]`, where `msg` has room for 72 more bytes (the padding is written
 * in place: no copy of the message). */
static void sha256_padded(uint8_t *msg, size_t len, uint8_t out[32], compress_fn compress) {
    uint32_t state[8];
    memcpy(state, H0, sizeof state);
    size_t total = (len + 9 + 63) / 64 * 64;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, total - len - 9);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++)
        msg[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(state, msg, total / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(state[i] >> 8);
        out[4 * i + 3] = (uint8_t)state[i];
    }
}

/* The pickle of `(parent, tuple(tokens), None)`, protocol 5; returns its length. */
static size_t pickle_key(uint8_t *buf, const uint8_t *parent, size_t parent_len,
                         const uint32_t *tokens, Py_ssize_t block_size) {
    uint8_t *p = buf + 11; /* PROTO and FRAME go in front once the frame's length is known */
    *p++ = 'C';
    *p++ = (uint8_t)parent_len;
    memcpy(p, parent, parent_len);
    p += parent_len;
    *p++ = 0x94; /* MEMOIZE */
    *p++ = '(';  /* MARK */
    for (Py_ssize_t i = 0; i < block_size; i++) {
        uint32_t v = tokens[i];
        if (v < 0x100) {
            *p++ = 'K';
            *p++ = (uint8_t)v;
        } else if (v < 0x10000) {
            *p++ = 'M';
            *p++ = (uint8_t)v;
            *p++ = (uint8_t)(v >> 8);
        } else {
            /* BININT is a signed 32-bit int; above that LONG1 with a sign byte of 0. */
            int wide = v >= 0x80000000u;
            if (wide) {
                *p++ = 0x8a;
                *p++ = 5;
            } else {
                *p++ = 'J';
            }
            *p++ = (uint8_t)v;
            *p++ = (uint8_t)(v >> 8);
            *p++ = (uint8_t)(v >> 16);
            *p++ = (uint8_t)(v >> 24);
            if (wide)
                *p++ = 0;
        }
    }
    static const uint8_t tail[] = {'t', 0x94, 'N', 0x87, 0x94, '.'};
    memcpy(p, tail, sizeof tail);
    p += sizeof tail;
    uint64_t frame = (uint64_t)(p - (buf + 11));
    buf[0] = 0x80; /* PROTO 5 */
    buf[1] = 5;
    buf[2] = 0x95; /* FRAME, its length little-endian */
    for (int i = 0; i < 8; i++)
        buf[3 + i] = (uint8_t)(frame >> (8 * i));
    return (size_t)(p - buf);
}

/* Copies block `tokens[first:first + block_size]` of a list of ints into `out`; -1 with an
 * exception set when an item is not an int in [0, 2**32), a token id's range. */
static int read_block(PyObject *tokens, Py_ssize_t first, Py_ssize_t block_size, uint32_t *out) {
    for (Py_ssize_t i = 0; i < block_size; i++) {
        PyObject *item = PyList_GET_ITEM(tokens, first + i);
        if (!PyLong_CheckExact(item)) { /* pickle writes a bool or an int subclass otherwise */
            PyErr_Format(PyExc_TypeError, "tokens[%zd] is not an int", first + i);
            return -1;
        }
        unsigned long v = PyLong_AsUnsignedLong(item);
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFul) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "tokens[%zd] is not a token id in [0, 2**32)",
                         first + i);
            return -1;
        }
        out[i] = (uint32_t)v;
    }
    return 0;
}

PyDoc_STRVAR(chain_doc,
             "sha256_pickle_chain(parent, tokens, start, count, block_size) -> list[bytes]\n\n"
             "vLLM's sha256 block hashes of `count` full blocks of `tokens` (a list of token\n"
             "ids) from index `start`, the first chained to `parent`.");

static PyObject *sha256_pickle_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "sha256_pickle_chain() takes 5 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    PyObject *parent = args[0];
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) > 255) {
        PyErr_SetString(PyExc_TypeError, "parent must be bytes shorter than 256");
        return NULL;
    }
    PyObject *tokens = args[1];
    if (!PyList_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list of ints");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[4]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size < 4 || block_size > MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [4, %d], not %zd", MAX_BLOCK_SIZE,
                     block_size);
        return NULL;
    }
    Py_ssize_t available = PyList_GET_SIZE(tokens) - start;
    if (start < 0 || count < 0 || available < 0 || count > available / block_size) {
        PyErr_SetString(PyExc_ValueError, "the blocks run past the end of tokens");
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    const uint8_t *prev = (const uint8_t *)PyBytes_AS_STRING(parent);
    size_t prev_len = (size_t)PyBytes_GET_SIZE(parent);
    uint32_t block[MAX_BLOCK_SIZE];
    uint8_t buf[PICKLE_MAX + 72];
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *digest;
        if (read_block(tokens, start + i * block_size, block_size, block) < 0 ||
            (digest = PyBytes_FromStringAndSize(NULL, 32)) == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        size_t len = pickle_key(buf, prev, prev_len, block, block_size);
        sha256_padded(buf, len, (uint8_t *)PyBytes_AS_STRING(digest), best_compress);
        PyList_SET_ITEM(out, i, digest);
        prev = (const uint8_t *)PyBytes_AS_STRING(digest);
        prev_len = 32;
    }
    return out;
}

PyDoc_STRVAR(sha256_doc, "sha256(data, portable=False) -> bytes\n\n"
                         "SHA-256 of `data` by the SHA instructions when the CPU has them\n"
                         "(or by the portable code when `portable`): for the tests.");

static PyObject *sha256(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"data", "portable", NULL};
    Py_buffer data;
    int portable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|p", keywords, &data, &portable))
        return NULL;
    uint8_t *copy = PyMem_Malloc((size_t)data.len + 72);
    if (copy == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    memcpy(copy, data.buf, (size_t)data.len);
    uint8_t out[32];
    sha256_padded(copy, (size_t)data.len, out, portable ? compress_portable : best_compress);
    PyMem_Free(copy);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *uses_sha_instructions(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(best_compress != compress_portable);
}

static PyMethodDef methods[] = {
    {"sha256_pickle_chain", (PyCFunction)(void (*)(void))sha256_pickle_chain, METH_FASTCALL,
     chain_doc},
    {"sha256", (PyCFunction)(void (*)(void))sha256, METH_VARARGS | METH_KEYWORDS, sha256_doc},
    {"uses_sha_instructions", uses_sha_instructions, METH_NOARGS,
     "Whether SHA-256 runs on the CPU's SHA instructions."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "engined.core._block_hash",
    "vLLM 0.33's default block hash in C (see _block_hash.c).", 0, methods};

PyMODINIT_FUNC PyInit__block_hash(void) {
#ifdef HAVE_SHA_NI_PATH
    if (cpu_has_sha_ni())
        best_compress = compress_sha_ni;
#endif
    return PyModuleDef_Init(&module_def);
}
