/* The same-host data path's alternatives, measured on one machine (docs/shm.md): 2 MiB values
 * moved between two processes' memory by
 *   - memcpy in one process (the ceiling; what the shm transport's server does, into a memfd
 *     mapping shared with the client),
 *   - process_vm_readv (CMA: the kernel copies from another process),
 *   - a unix stream socket and loopback TCP (a writer and a reader process: two kernel copies).
 * One thread per side. GB/s = 1e9 B/s. Each value comes from and goes to the next of 32 buffers
 * (64 MiB each way, past the caches), all pages written before the clock starts.
 * Build and run: cc -O2 -o /tmp/shm_alternatives benchmarks/shm_alternatives.c && /tmp/shm_alternatives
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define V ((size_t)2 << 20)
#define BUFS 32
#define N 2048 /* 4 GiB per measurement */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void full(int fd, char *b, size_t n, int rd) {
    size_t o = 0;
    while (o < n) {
        ssize_t r = rd ? read(fd, b + o, n - o) : write(fd, b + o, n - o);
        if (r <= 0) {
            perror("io");
            exit(1);
        }
        o += r;
    }
}

static char *src_at(char *b, int i) { return b + (size_t)((i * 7) % BUFS) * V; }
static char *dst_at(char *b, int i) { return b + (size_t)(i % BUFS) * V; }

int main(void) {
    size_t pool = BUFS * V;
    char *src = mmap(0, pool, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int mfd = memfd_create("shm-alternatives", 0);
    if (ftruncate(mfd, pool) != 0) return 1;
    char *dst = mmap(0, pool, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    memset(src, 1, pool);
    memset(dst, 2, pool);
    double t = now();
    for (int i = 0; i < N; i++) memcpy(dst_at(dst, i), src_at(src, i), V);
    double mc = (double)N * V / (now() - t) / 1e9;
    printf("memcpy into a shared memfd mapping, 1 thread: %.2f GB/s\n", mc);
    fflush(stdout);
    pid_t parent = getpid();
    pid_t c = fork();
    if (!c) {
        double t = now();
        for (int i = 0; i < N; i++) {
            struct iovec l = {dst_at(dst, i), V}, r = {src_at(src, i), V};
            if (process_vm_readv(parent, &l, 1, &r, 1, 0) != (ssize_t)V) {
                perror("process_vm_readv");
                _exit(1);
            }
        }
        double g = (double)N * V / (now() - t) / 1e9;
        printf("process_vm_readv (CMA), 1 thread: %.2f GB/s (%.2f of memcpy)\n", g, g / mc);
        fflush(stdout);
        _exit(0);
    }
    waitpid(c, 0, 0);
    for (int kind = 0; kind < 2; kind++) {
        int s[2];
        if (kind == 0) {
            socketpair(AF_UNIX, SOCK_STREAM, 0, s);
        } else {
            int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
            socklen_t al = sizeof a;
            bind(l, (void *)&a, sizeof a);
            getsockname(l, (void *)&a, &al);
            listen(l, 1);
            s[1] = socket(AF_INET, SOCK_STREAM, 0);
            connect(s[1], (void *)&a, sizeof a);
            s[0] = accept(l, 0, 0);
            close(l);
            setsockopt(s[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        }
        pid_t w = fork();
        if (!w) {
            close(s[0]);
            for (int i = 0; i < N; i++) full(s[1], src_at(src, i), V, 0);
            _exit(0);
        }
        close(s[1]);
        double t = now();
        for (int i = 0; i < N; i++) full(s[0], dst_at(dst, i), V, 1);
        double g = (double)N * V / (now() - t) / 1e9;
        printf("%s, writer and reader process: %.2f GB/s (%.2f of memcpy)\n",
               kind ? "loopback TCP" : "unix stream socket", g, g / mc);
        waitpid(w, 0, 0);
        close(s[0]);
    }
    return 0;
}
