"""PageAllocator: which pages of the KV pool are free. Owns no tensors; pure bookkeeping on the host.

Page 0 is reserved: slot 0 is the padding slot every padded batch entry may write to.
Sizes are reported in tokens (pages * page_size) so that page_size 1 and 16 read the same.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised by alloc when fewer pages are free than asked; nothing is allocated then."""


class PageAllocator:
    def __init__(self, num_slots: int, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        num_pages = num_slots // page_size
        if num_pages < 2:
            raise ValueError(f"KV pool of {num_slots} slots is too small for page_size {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        # A stack: recently freed pages are reused first (their cache lines may still be warm).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def total_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def can_alloc(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def alloc(self, num_pages: int) -> list[int]:
        """Take num_pages pages. Raises OutOfPages (allocating nothing) if not enough are free."""
        if num_pages > len(self._free):
            raise OutOfPages(f"asked for {num_pages} pages, {len(self._free)} free")
        if num_pages == 0:
            return []
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages. A double free or a free of page 0 is a bug and raises."""
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise RuntimeError(f"invalid or double free of KV page {p}")
            self._is_free[p] = 1
        self._free.extend(pages)

    def free_slots(self, slots: list[int]) -> None:
        """Free the pages behind a page-aligned run of slots (every page given whole, in order)."""
        ps = self.page_size
        if len(slots) % ps:
            raise RuntimeError(f"freeing {len(slots)} slots, not a multiple of page_size {ps}")
        self.free([slots[i] // ps for i in range(0, len(slots), ps)])


def pages_to_slots(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + j for p in pages for j in range(page_size)]


class AllocatorSizes:
    """Token counts of an owner that hands out its slots through `self.allocator` (a PageAllocator)."""

    allocator: PageAllocator

    @property
    def total_tokens(self) -> int:
        return self.allocator.total_tokens

    @property
    def free_tokens(self) -> int:
        return self.allocator.free_tokens
