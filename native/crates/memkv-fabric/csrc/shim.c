/*
 * memkv's shim over libfabric. libfabric exports only a handful of functions (fi_getinfo,
 * fi_freeinfo, fi_dupinfo, fi_fabric, fi_strerror, fi_version); everything else (fi_domain,
 * fi_endpoint, fi_mr_reg, fi_read, fi_write, fi_cq_read, fi_av_insert, fi_close, ...) is a
 * static inline function in the headers that calls through the object's ops table. This file
 * is compiled against the vendored headers in ../include (libfabric 1.17, used under their BSD
 * license option), so the compiler, not hand-written Rust, knows every struct layout. It never
 * links libfabric: the exported functions reach it as pointers the Rust side looked up with
 * dlopen/dlsym (struct mk_api), and the inline ones need no symbol at all.
 *
 * Every function returns 0 or a negative libfabric error code (-FI_E...), like libfabric.
 */
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* The exported libfabric functions, looked up at run time. */
struct mk_api {
	int (*getinfo)(uint32_t version, const char *node, const char *service, uint64_t flags,
		       const struct fi_info *hints, struct fi_info **info);
	void (*freeinfo)(struct fi_info *info);
	struct fi_info *(*dupinfo)(const struct fi_info *info);
	int (*fabric)(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
};

/* The API version we ask for: the oldest that has every call and mode bit used here. Device
 * memory (FI_HMEM, fi_mr_attr's iface and device) came with 1.10, asked for only with it. */
#define MK_FI_VERSION FI_VERSION(1, 9)
#define MK_FI_VERSION_HMEM FI_VERSION(1, 10)

/* The capabilities memkv needs: the server reads and writes client memory (FI_READ,
 * FI_WRITE), the client's memory is the target (FI_REMOTE_READ, FI_REMOTE_WRITE). */
#define MK_CAPS (FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE)

/* Memory-registration modes memkv handles (see the Rust side for what each changes). */
#define MK_MR_MODES (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY)

/* `hmem`: also ask for device memory (FI_HMEM; FI_MR_HMEM: such memory is registered, which
 * memkv does for every buffer anyway). A provider without it then lists nothing: the caller asks
 * again without. `op_flags` and `msg_order` are the transmit attributes asked for: the completion
 * semantics of the server's writes (FI_DELIVERY_COMPLETE, or read-after-write ordering for the
 * fallback fence; see write_completion in lib.rs). They stay in the returned entries, so an
 * endpoint opened on one of them gets them as its defaults. */
int mk_getinfo(const struct mk_api *api, const char *prov_name, int hmem, uint64_t op_flags,
	       uint64_t msg_order, struct fi_info **out)
{
	struct fi_info *hints = api->dupinfo(NULL);
	int ret;

	if (!hints)
		return -FI_ENOMEM;
	hints->caps = MK_CAPS | (hmem ? FI_HMEM : 0);
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->ep_attr->type = FI_EP_RDM;
	hints->domain_attr->mr_mode = MK_MR_MODES | (hmem ? FI_MR_HMEM : 0);
	hints->domain_attr->threading = FI_THREAD_SAFE;
	hints->tx_attr->op_flags = op_flags;
	hints->tx_attr->msg_order = msg_order;
	if (prov_name) {
		hints->fabric_attr->prov_name = strdup(prov_name);
		if (!hints->fabric_attr->prov_name) {
			api->freeinfo(hints);
			return -FI_ENOMEM;
		}
	}
	ret = api->getinfo(hmem ? MK_FI_VERSION_HMEM : MK_FI_VERSION, NULL, NULL, 0, hints, out);
	api->freeinfo(hints); /* frees prov_name too */
	return ret;
}

struct fi_info *mk_info_next(const struct fi_info *info) { return info->next; }
const char *mk_info_prov(const struct fi_info *info) { return info->fabric_attr->prov_name; }
const char *mk_info_domain(const struct fi_info *info) { return info->domain_attr->name; }
const char *mk_info_fabric(const struct fi_info *info) { return info->fabric_attr->name; }
uint64_t mk_info_mr_mode(const struct fi_info *info) { return info->domain_attr->mr_mode; }
size_t mk_info_tx_size(const struct fi_info *info) { return info->tx_attr->size; }
size_t mk_info_max_msg(const struct fi_info *info) { return info->ep_attr->max_msg_size; }
size_t mk_info_key_size(const struct fi_info *info) { return info->domain_attr->mr_key_size; }
uint64_t mk_info_caps(const struct fi_info *info) { return info->caps; }
/* Whether the provider's endpoint addresses are NUL-terminated strings of varying length (shm:
 * FI_ADDR_STR) rather than structures of one size (sockaddr, verbs, efa). */
int mk_info_addr_str(const struct fi_info *info) { return info->addr_format == FI_ADDR_STR; }
/* Caps the receive queue of endpoints opened with `info` at `size` entries (memkv posts no
 * receive; see tuning.rs). */
void mk_info_shrink_rx(struct fi_info *info, size_t size)
{
	if (info->rx_attr->size > size)
		info->rx_attr->size = size;
}

int mk_open_domain(const struct mk_api *api, struct fi_info *info, struct fid_fabric **fabric,
		   struct fid_domain **domain)
{
	int ret = api->fabric(info->fabric_attr, fabric, NULL);

	if (ret)
		return ret;
	ret = fi_domain(*fabric, info, domain, NULL);
	if (ret) {
		fi_close(&(*fabric)->fid);
		*fabric = NULL;
	}
	return ret;
}

/* An RDM endpoint bound to a new completion queue and address vector, enabled. The CQ
 * reports the context of each operation; `wait_fd` (or -1 when the provider has no wait
 * object we can poll) becomes readable when the CQ may have work to do. */
int mk_open_ep(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
	       struct fid_cq **cq, struct fid_av **av, int *wait_fd)
{
	struct fi_cq_attr cq_attr;
	struct fi_av_attr av_attr;
	int ret;

	*ep = NULL;
	*cq = NULL;
	*av = NULL;
	*wait_fd = -1;
	memset(&cq_attr, 0, sizeof(cq_attr));
	cq_attr.format = FI_CQ_FORMAT_CONTEXT;
	cq_attr.size = info->tx_attr->size;
	cq_attr.wait_obj = FI_WAIT_FD;
	ret = fi_cq_open(domain, &cq_attr, cq, NULL);
	if (ret == -FI_ENOSYS || ret == -FI_EINVAL) {
		cq_attr.wait_obj = FI_WAIT_NONE;
		ret = fi_cq_open(domain, &cq_attr, cq, NULL);
	}
	if (ret)
		goto fail;
	if (cq_attr.wait_obj == FI_WAIT_FD && fi_control(&(*cq)->fid, FI_GETWAIT, wait_fd))
		*wait_fd = -1;
	memset(&av_attr, 0, sizeof(av_attr));
	av_attr.type = FI_AV_UNSPEC;
	ret = fi_av_open(domain, &av_attr, av, NULL);
	if (ret)
		goto fail;
	ret = fi_endpoint(domain, info, ep, NULL);
	if (ret)
		goto fail;
	ret = fi_ep_bind(*ep, &(*cq)->fid, FI_TRANSMIT | FI_RECV);
	if (ret)
		goto fail;
	ret = fi_ep_bind(*ep, &(*av)->fid, 0);
	if (ret)
		goto fail;
	ret = fi_enable(*ep);
	if (ret)
		goto fail;
	return 0;
fail:
	if (*ep)
		fi_close(&(*ep)->fid);
	if (*av)
		fi_close(&(*av)->fid);
	if (*cq)
		fi_close(&(*cq)->fid);
	*ep = NULL;
	*av = NULL;
	*cq = NULL;
	*wait_fd = -1;
	return ret;
}

/* Closes any libfabric object: every fid_* struct starts with its struct fid. */
int mk_close(void *fid) { return fi_close((struct fid *)fid); }

int mk_getname(struct fid_ep *ep, void *addr, size_t *len) { return fi_getname(&ep->fid, addr, len); }

int mk_av_insert(struct fid_av *av, const void *addr, uint64_t *fi_addr)
{
	fi_addr_t a = FI_ADDR_NOTAVAIL;
	int n = fi_av_insert(av, addr, 1, &a, 0, NULL);

	if (n < 0)
		return n;
	if (n != 1)
		return -FI_EADDRNOTAVAIL;
	*fi_addr = a;
	return 0;
}

/* Registers [buf, buf+len) for `access` (FI_READ | FI_WRITE | FI_REMOTE_READ | ...).
 * `requested_key` matters only without FI_MR_PROV_KEY. `iface` is FI_HMEM_SYSTEM for host
 * memory (registered with fi_mr_reg, as every provider supports) or FI_HMEM_CUDA for memory of
 * CUDA device `device` (fi_mr_regattr, which carries the interface; only on a domain opened
 * with FI_HMEM, where libfabric passes it on to the provider instead of assuming host memory). */
int mk_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
	      uint64_t requested_key, int iface, int device, struct fid_mr **mr, void **desc,
	      uint64_t *key)
{
	struct fi_mr_attr attr;
	struct iovec iov;
	int ret;

	if (iface == FI_HMEM_SYSTEM) {
		ret = fi_mr_reg(domain, buf, len, access, 0, requested_key, 0, mr, NULL);
	} else {
		memset(&attr, 0, sizeof(attr));
		iov.iov_base = buf;
		iov.iov_len = len;
		attr.mr_iov = &iov;
		attr.iov_count = 1;
		attr.access = access;
		attr.requested_key = requested_key;
		attr.iface = (enum fi_hmem_iface)iface;
		attr.device.cuda = device;
		ret = fi_mr_regattr(domain, &attr, 0, mr);
	}
	if (ret)
		return ret;
	*desc = fi_mr_desc(*mr);
	*key = fi_mr_key(*mr);
	if (*key == FI_KEY_NOTAVAIL) {
		fi_close(&(*mr)->fid);
		*mr = NULL;
		return -FI_ENOKEY;
	}
	return 0;
}

/* Access flag values, so the Rust side needs no copy of the headers' numbers. */
uint64_t mk_access_local_read(void) { return FI_READ; }
uint64_t mk_access_local_write(void) { return FI_WRITE; }
uint64_t mk_access_remote_read(void) { return FI_REMOTE_READ; }
uint64_t mk_access_remote_write(void) { return FI_REMOTE_WRITE; }
uint64_t mk_mr_virt_addr(void) { return FI_MR_VIRT_ADDR; }
uint64_t mk_mr_prov_key(void) { return FI_MR_PROV_KEY; }
uint64_t mk_mr_local(void) { return FI_MR_LOCAL; }
uint64_t mk_cap_hmem(void) { return FI_HMEM; }
int mk_hmem_system(void) { return FI_HMEM_SYSTEM; }
int mk_hmem_cuda(void) { return FI_HMEM_CUDA; }
uint64_t mk_op_delivery_complete(void) { return FI_DELIVERY_COMPLETE; }
uint64_t mk_order_raw(void) { return FI_ORDER_RAW; }
size_t mk_context_size(void) { return sizeof(struct fi_context2); }

/* One RDMA write (local to remote) or read (remote into local). */
ssize_t mk_rma(struct fid_ep *ep, int write, void *buf, size_t len, void *desc, uint64_t peer,
	       uint64_t addr, uint64_t key, void *context)
{
	if (write)
		return fi_write(ep, buf, len, desc, peer, addr, key, context);
	return fi_read(ep, buf, len, desc, peer, addr, key, context);
}

/* Reads up to `count` completions into `contexts`; returns how many (0 when none), or, for a
 * failed operation, -FI_EAVAIL with its context in `err_context` and its error (positive
 * FI_E... code) in `err`. Every call also drives the provider's progress. */
ssize_t mk_cq_read(struct fid_cq *cq, void **contexts, size_t count, void **err_context,
		   int *err, int *prov_errno)
{
	struct fi_cq_entry entries[16];
	struct fi_cq_err_entry e;
	ssize_t n, i;

	if (count > 16)
		count = 16;
	n = fi_cq_read(cq, entries, count);
	if (n == -FI_EAGAIN)
		return 0;
	if (n == -FI_EAVAIL) {
		memset(&e, 0, sizeof(e));
		n = fi_cq_readerr(cq, &e, 0);
		if (n == -FI_EAGAIN)
			return 0;
		if (n < 0)
			return n;
		*err_context = e.op_context;
		*err = e.err;
		*prov_errno = e.prov_errno;
		return -FI_EAVAIL;
	}
	for (i = 0; i < n; i++)
		contexts[i] = entries[i].op_context;
	return n;
}

/* 0 when the caller may block on the CQ's wait fd, -FI_EAGAIN when it must read the CQ
 * first (see fi_trywait(3)). */
int mk_trywait(struct fid_fabric *fabric, struct fid_cq *cq)
{
	struct fid *f = &cq->fid;

	return fi_trywait(fabric, &f, 1);
}

int mk_eagain(void) { return FI_EAGAIN; }
int mk_eavail(void) { return FI_EAVAIL; }
